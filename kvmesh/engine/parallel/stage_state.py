"""A checkpoint as one pipeline stage reads it (see shard.py): the stage's decoder layers
renumbered from 0, the token embedding on the first stage (and on the last when the LM head is
the tied table), the final norm and the LM head on the last; other stages' tensors are absent,
so they are never read from disk."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.parallel.shard import TensorShard

_LAYERS = "model.layers."


class StageState(Mapping):
    partial = True  # the model builds without the tables and norm other stages hold

    def __init__(self, state: Any, config: ModelConfig, shard: TensorShard) -> None:
        self.state, self.layers = state, shard.layers(config)
        tied = config.tie_word_embeddings or "lm_head.weight" not in state
        self._kept = {
            "model.embed_tokens.weight": shard.first or (shard.last and tied),
            "lm_head.weight": shard.last,
            "model.norm.weight": shard.last,
        }
        self._lazy = hasattr(state, "read")

    def _renamed(self, name: str, by: int, within: range) -> str | None:
        """`name` with its layer index moved by `by` (None: outside `within`, or not kept)."""
        if name.startswith(_LAYERS):
            index, _, rest = name[len(_LAYERS) :].partition(".")
            if index.isdigit():
                return f"{_LAYERS}{int(index) + by}.{rest}" if int(index) in within else None
        return name if self._kept.get(name, True) else None

    def _original(self, name: str) -> str | None:
        return self._renamed(name, self.layers.start, range(len(self.layers)))

    def __contains__(self, name: object) -> bool:
        original = self._original(name) if isinstance(name, str) else None
        return original is not None and original in self.state

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise KeyError(name)
        return self.state[self._original(name)]

    def __iter__(self) -> Iterator[str]:
        local = (self._renamed(n, -self.layers.start, self.layers) for n in list(self.state))
        return (n for n in local if n is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def keys(self):  # noqa: D102 - Mapping's, the stage's names only
        return list(iter(self))

    def pop(self, name: str, dtype: torch.dtype | None = None) -> Any:
        if name not in self:
            raise KeyError(name)
        original = self._original(name)
        if self._lazy:
            return self.state.pop(original, dtype=dtype)
        tensor = self.state.pop(original)
        return (
            tensor.to(dtype) if dtype is not None and isinstance(tensor, torch.Tensor) else tensor
        )

    def pop_slice(
        self, name: str, dim: int, start: int, length: int, dtype: torch.dtype | None = None
    ) -> Any:
        if name not in self:
            raise KeyError(name)
        return self.state.pop_slice(self._original(name), dim, start, length, dtype)

    def can_slice(self, name: str) -> bool:
        can = getattr(self.state, "can_slice", None)
        return can is not None and name in self and can(self._original(name))

    def read(self, name: str) -> Any:
        return self.state.read(self._original(name)) if self._lazy else self[name]
