"""The attention-backend contract and the per-step metadata the runner builds for it.

Token layout of one step: the `num_decode` single-token rows come first, then each
prefill chunk's tokens contiguously (`PrefillSpan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Slots:
    """Cache slots as (page, offset-in-page) index tensors of the same shape."""

    page: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def of(cls, flat: torch.Tensor, page_size: int) -> Slots:
        """From flat slot numbers `page * page_size + offset`."""
        return cls(torch.div(flat, page_size, rounding_mode="floor"), flat % page_size)


@dataclass(frozen=True)
class PrefillSpan:
    """One multi-token chunk: rows [begin, end) of the step, at positions [context_start, ...)."""

    begin: int
    end: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    gather_index: (
        torch.Tensor | None
    )  # [context_start + n] cache slots; None when context_start == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: Slots  # [T]: cache slot each new token's K/V is written to
    num_decode: int
    decode_gather: Slots | None  # [B, Lmax]: cache slots of each decode row's context
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool: True where a slot is real context
    prefills: tuple[PrefillSpan, ...]


class LayerKV(Protocol):
    """One layer of the paged cache in its storage format (plain or FP8; see kv_cache.py)."""

    def write(self, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hkv, D] of new tokens at `slots` (quantizing if the format does)."""
        ...

    def read(self, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S) as [*S, Hkv, D] in the compute dtype."""
        ...

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as `read` returns them after a `write` (rounded through the storage format)."""
        ...


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache and attends over each row's context."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...
