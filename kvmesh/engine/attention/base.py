"""The attention-backend contracts and the per-step metadata the torch backends build.

Token layout of one step: the `num_decode` single-token rows come first, then each
multi-token chunk's rows contiguously (`PrefillSpan`). A backend builds its own metadata from
the step's block tables and sequence lengths (`BatchLayout`), once per step, and every layer of
its kind reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
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
class BatchLayout:
    """What attention needs to know of a step, per chunk in row order (decode rows first):
    the request's block table, the tokens already cached before the chunk, the chunk's rows."""

    num_decode: int
    # a tuple of page ids per row, or for a step of decode rows only, one [rows, W] int32
    # array null-padded past each row's pages (the runner's persistent tables, block_tables.py)
    block_tables: tuple[tuple[int, ...], ...] | np.ndarray
    starts: tuple[int, ...]
    widths: tuple[int, ...]
    page_size: int
    null_page: int  # an all-zero page nothing writes: where padding slots point (kv_cache.py)
    table_width: int = 0  # decode block tables padded to at least this many pages (compiled.py)


@dataclass(frozen=True)
class PrefillSpan:
    """One multi-token chunk: rows [begin, end) of the step, at positions [context_start, ...)."""

    begin: int
    end: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    gather_index: Slots | None  # [context_start + n] cache slots; None when context_start == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: Slots  # [T]: cache slot each new token's K/V is written to
    num_decode: int
    decode_gather: Slots | None  # [B, Lmax]: cache slots of each decode row's context
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool: True where a slot is real context
    prefills: tuple[PrefillSpan, ...]


class AttentionBackend(Protocol):
    """Builds a step's metadata; the kind-specific `forward` writes the new tokens' KV into the
    paged cache and attends over each row's context (GQA: q, k, v; MLA: see torch_mla.py)."""

    kind: str  # the KV kind it serves (kv/layout.py)
    compilable: bool  # a torch.compile graph can hold its ops (runner/compiled.py)

    def build_metadata(self, layout: BatchLayout) -> Any: ...

    def forward(self, *args: Any) -> torch.Tensor: ...
