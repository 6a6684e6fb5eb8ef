"""A checkpoint as one tensor-parallel rank reads it (see shard.py for what each rank keeps)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.quant.int4 import Int4Weight
from kvmesh.errors import ModelFormatError

# checkpoint name suffix -> which range; column-parallel split their rows (dimension 0),
# row-parallel their columns (dimension 1, their biases on rank 0)
_COLUMN = {
    ".q_proj": "q",
    ".q_b_proj": "q",
    ".k_proj": "kv",
    ".v_proj": "kv",
    ".kv_b_proj": "kv_b",
    ".gate_proj": "mlp",
    ".up_proj": "mlp",
}
_ROW = {".o_proj": "o", ".down_proj": "mlp"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")  # rows split by token id


class ShardedState(Mapping):
    """A checkpoint's state dict as rank `shard.rank` reads it: each split weight sliced to the
    rank's part as it is taken (the full tensor is dropped at once), the row-parallel biases
    absent beyond rank 0."""

    def __init__(self, state: Any, config: ModelConfig, shard: TensorShard) -> None:
        self.state, self.shard = state, shard
        self._ranges = shard.ranges(config)
        self._experts = shard.experts(config)
        self._lazy = hasattr(state, "read")

    def _rule(self, name: str) -> tuple[str, int] | None:
        """(which range, which dimension) a tensor is sliced by; None: whole; ("rank0", 0): a
        row-parallel bias (rank 0's); ("absent", 0): another rank's expert."""
        if name in _VOCAB:
            return "vocab", 0
        stem, _, kind = name.rpartition(".")
        if stem.endswith(".experts"):
            raise ModelFormatError(
                f"tensor parallelism cannot split the fused expert tensor "
                f"{name} (per-expert checkpoints only)"
            )
        expert = _expert_of(name)
        if expert is not None and self.shard.expert_parallel:
            return None if expert in self._experts else ("absent", 0)
        mlp = "expert" if expert is not None else "shared" if ".shared_experts." in name else "mlp"
        for suffix, part in (*_COLUMN.items(), *_ROW.items()):
            if not stem.endswith(suffix):
                continue
            part = mlp if part == "mlp" else part
            if suffix in _ROW:
                return ("rank0", 0) if kind == "bias" else (part, 1)
            return part, 0
        return None

    def _hidden(self, name: str) -> bool:
        rule = self._rule(name)
        return rule is not None and (
            rule[0] == "absent" or (rule[0] == "rank0" and self.shard.rank != 0)
        )

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
        part = self._part(name)
        can_slice = getattr(self.state, "can_slice", None)
        if part is not None and can_slice is not None and can_slice(name):
            return self.state.pop_slice(name, *part, dtype=dtype)  # only this rank's part read
        tensor = self.state.pop(name, dtype=dtype) if self._lazy else self.state.pop(name)
        if dtype is not None and isinstance(tensor, torch.Tensor) and not self._lazy:
            tensor = tensor.to(dtype)
        return self._slice(name, tensor)

    def read(self, name: str) -> Any:  # what `Weights` looks for to cast while reading
        return self[name]

    @property
    def partial(self) -> bool:  # a pipeline stage's view underneath (stage_state.py)
        return getattr(self.state, "partial", False)

    @property
    def whole(self) -> Any:
        """The checkpoint itself: a pack-quantized linear is read whole, then `sliced`."""
        return self.state

    def sliced(self, name: str, tensor: Any) -> Any:
        """This rank's part of `tensor`, read whole as `name` (an INT4 weight: by whole groups)."""
        return self._slice(name, tensor)

    def _part(self, name: str) -> tuple[int, int, int] | None:
        """(dimension, start, length) of a dense tensor's part this rank keeps, or None."""
        rule = self._rule(name)
        if rule is None or rule[0] in ("rank0", "absent"):
            return None
        part, dim = rule
        if name.rpartition(".")[2] not in ("weight", "bias"):
            return None
        keep = self._ranges[part]
        return dim, keep.start, len(keep)

    def _slice(self, name: str, tensor: Any) -> Any:
        rule = self._rule(name)
        if rule is None or rule[0] in ("rank0", "absent"):
            return tensor
        part, dim = rule
        if name.rpartition(".")[2] not in ("weight", "bias"):
            raise ModelFormatError(
                f"{name}: a quantized checkpoint's own tensor is split only "
                "as the weight it makes (Weights.raw)"
            )
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


def _expert_of(name: str) -> int | None:
    """The routed expert a tensor belongs to (`...experts.E....`), else None."""
    _, found, rest = name.partition(".experts.")
    head = rest.split(".", 1)[0]
    return int(head) if found and head.isdigit() else None
