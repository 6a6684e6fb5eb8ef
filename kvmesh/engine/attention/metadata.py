"""Metadata of the torch backends: gather indices of each row's context in the paged cache."""

from __future__ import annotations

import torch

from kvmesh.engine.attention.base import AttentionMetadata, BatchLayout, PrefillSpan, Slots


def build_torch_metadata(layout: BatchLayout) -> AttentionMetadata:
    size, decode = layout.page_size, layout.num_decode
    offsets = torch.arange(size)
    slots: list[torch.Tensor] = []
    gather = mask = None
    if decode:
        tables, starts = layout.block_tables[:decode], layout.starts[:decode]
        gather, mask, new = _decode(tables, starts, offsets, layout.null_page)
        slots.append(new)
    spans_slots, spans = prefill_spans(layout)
    slots.extend(spans_slots)
    return AttentionMetadata(Slots.of(torch.cat(slots), size), decode, gather, mask, spans)


def prefill_spans(layout: BatchLayout) -> tuple[list[torch.Tensor], tuple[PrefillSpan, ...]]:
    """Each multi-token chunk's span and the cache slots its new tokens are written to."""
    size, offsets = layout.page_size, torch.arange(layout.page_size)
    decode, row = layout.num_decode, layout.num_decode
    slots: list[torch.Tensor] = []
    spans: list[PrefillSpan] = []
    for table, start, width in zip(
        layout.block_tables[decode:], layout.starts[decode:], layout.widths[decode:], strict=True
    ):
        every = _slots_of(table, start + width, offsets)
        index = Slots.of(every, size) if start > 0 else None
        spans.append(PrefillSpan(row, row + width, start, index))
        slots.append(every[start:])
        row += width
    return slots, tuple(spans)


def _slots_of(table: tuple[int, ...], length: int, offsets: torch.Tensor) -> torch.Tensor:
    size = len(offsets)
    pages = torch.tensor(table[: (length + size - 1) // size])
    return (pages.unsqueeze(1) * size + offsets).flatten()[:length]


def _decode(tables, starts, offsets: torch.Tensor, null_page: int):
    """Each row's context slots, padded to the longest with slots of the null page."""
    size = len(offsets)
    lengths = torch.tensor(starts) + 1
    longest = int(lengths.max())
    width = (longest + size - 1) // size
    padded = torch.tensor(
        [list(t[:width]) + [null_page] * (width - len(t[:width])) for t in tables]
    )
    gather = (padded.unsqueeze(-1) * size + offsets).flatten(1)[:, :longest]
    mask = torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)
    new_slots = gather.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    gather = torch.where(mask, gather, null_page * size)  # stale slots of a last page too
    return Slots.of(gather, size), mask[:, None, None, :], new_slots


def offset_causal_mask(n: int, offset: int, device: torch.device) -> torch.Tensor:
    """Query i (at position offset + i) sees keys 0..offset + i."""
    rows = torch.arange(n, device=device).unsqueeze(1) + offset
    cols = torch.arange(offset + n, device=device).unsqueeze(0)
    return cols <= rows
