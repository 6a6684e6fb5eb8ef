"""Tensor-parallel shards of a dense GQA decoder (pure data, no processes).

Rank r of N holds a contiguous range of the KV heads and the query heads that attend to them
(so a GQA group never spans two ranks; with 3 KV heads on 2 ranks the split is 1 + 2), and a
contiguous range of the MLP's intermediate features. Column-parallel: q / k / v and gate / up
keep their rows of the rank's heads / features; row-parallel: o and down keep the matching
columns, and their biases live on rank 0 only, so the sum over ranks (an all-reduce after each
attention and MLP) is the whole layer. Embedding, norms and LM head are replicated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.quant.int4 import Int4Weight
from kvmesh.errors import InvalidRequestError, ModelFormatError

# checkpoint name suffix -> (which range, which dimension of the weight: 0 rows, 1 columns)
_COLUMN = {".q_proj": "q", ".k_proj": "kv", ".v_proj": "kv", ".gate_proj": "mlp", ".up_proj": "mlp"}
_ROW = {".o_proj": "q", ".down_proj": "mlp"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")  # rows split by token id


def share(total: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous part of `total` units over `world` ranks."""
    return range(total * rank // world, total * (rank + 1) // world)


@dataclass(frozen=True)
class TensorShard:
    rank: int
    world: int

    def check(self, config: ModelConfig) -> None:
        """Whether this model splits over `world` ranks (the first slice: dense GQA)."""
        if config.mla is not None or config.moe is not None:
            raise InvalidRequestError(
                "tensor parallelism covers dense GQA models for now (no MLA or MoE layers)"
            )
        if config.num_kv_heads < self.world:
            raise InvalidRequestError(
                f"tensor parallel size {self.world} exceeds the model's {config.num_kv_heads} "
                "KV heads (replicated KV heads are not supported yet)"
            )

    def kv_heads(self, config: ModelConfig) -> range:
        return share(config.num_kv_heads, self.rank, self.world)

    def q_heads(self, config: ModelConfig) -> range:
        group = config.num_heads // config.num_kv_heads
        kv = self.kv_heads(config)
        return range(kv.start * group, kv.stop * group)

    def features(self, config: ModelConfig) -> range:
        return share(config.intermediate_size, self.rank, self.world)

    def vocab(self, config: ModelConfig) -> range:
        return share(config.vocab_size, self.rank, self.world)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's layers are built with (its heads and features)."""
        self.check(config)
        return replace(config, num_heads=len(self.q_heads(config)),
                       num_kv_heads=len(self.kv_heads(config)),
                       intermediate_size=len(self.features(config)))  # fmt: skip

    def ranges(self, config: ModelConfig) -> dict[str, range]:
        """Rows / columns of each weight kind this rank keeps, in checkpoint units."""
        hd = config.head_dim
        q, kv = self.q_heads(config), self.kv_heads(config)
        return {"q": range(q.start * hd, q.stop * hd), "kv": range(kv.start * hd, kv.stop * hd),
                "mlp": self.features(config), "vocab": self.vocab(config)}  # fmt: skip


class ShardedState(Mapping):
    """A checkpoint's state dict as rank `shard.rank` reads it: each split weight sliced to the
    rank's part as it is taken (the full tensor is dropped at once), the row-parallel biases
    absent beyond rank 0."""

    def __init__(self, state: Any, config: ModelConfig, shard: TensorShard) -> None:
        self.state, self.shard = state, shard
        self._ranges = shard.ranges(config)
        self._lazy = hasattr(state, "read")

    def _rule(self, name: str) -> tuple[str, int] | None:
        if name in _VOCAB:
            return "vocab", 0
        stem, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            return None
        for suffix, part in _COLUMN.items():
            if stem.endswith(suffix):
                return part, 0
        for suffix, part in _ROW.items():
            if stem.endswith(suffix):
                return (part, 1) if kind == "weight" else ("rank0", 0)
        return None

    def _hidden(self, name: str) -> bool:
        rule = self._rule(name)
        return rule is not None and rule[0] == "rank0" and self.shard.rank != 0

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.state and not self._hidden(name)

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise KeyError(name)
        return self._slice(name, self.state[name])

    def __iter__(self) -> Iterator[str]:
        return (n for n in list(self.state) if not self._hidden(n))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def keys(self):  # noqa: D102 - Mapping's, without the hidden biases
        return list(iter(self))

    def pop(self, name: str, dtype: torch.dtype | None = None) -> Any:
        if self._hidden(name):
            self.state.pop(name)
            raise KeyError(name)
        tensor = self.state.pop(name, dtype=dtype) if self._lazy else self.state.pop(name)
        if dtype is not None and isinstance(tensor, torch.Tensor) and not self._lazy:
            tensor = tensor.to(dtype)
        return self._slice(name, tensor)

    def read(self, name: str) -> Any:  # what `Weights` looks for to cast while reading
        return self[name]

    def _slice(self, name: str, tensor: Any) -> Any:
        rule = self._rule(name)
        if rule is None or rule[0] == "rank0":
            return tensor
        part, dim = rule
        keep = self._ranges[part]
        if isinstance(tensor, Int4Weight):
            try:
                return tensor.narrow(dim, keep.start, len(keep))
            except ValueError as exc:
                raise ModelFormatError(f"{name} cannot be split over the ranks: {exc}") from exc
        if not isinstance(tensor, torch.Tensor):
            raise ModelFormatError(
                f"tensor parallelism cannot split {name} ({type(tensor).__name__})"
            )
        return tensor.narrow(dim, keep.start, len(keep)).contiguous()
