"""CPU backends that attend decode rows over the KV pages in place (kernels/csrc/paged_attention):
the step's plan is each decode row's block table and length; the kernel walks the pages, FP8
dequantized inside it, with no per-step gather of every context. Prefill chunks, few per step
and compute bound, go through the torch reference backends' paths.

Numerics: scores, softmax and the weighted sum in fp32 with an online softmax (the reference
rounds bf16 scores); outputs agree with the reference within rounding (tests/unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvmesh.engine.attention.base import BatchLayout, PrefillSpan, Slots
from kvmesh.engine.attention.metadata import prefill_spans
from kvmesh.engine.attention.torch_backend import TorchAttention
from kvmesh.engine.attention.torch_mla import TorchMlaAttention
from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.layers.mla import MlaWeights
from kvmesh.engine.pool.kv_cache import GqaLayerKV, MlaLayerKV, PagedLayer
from kvmesh.engine.runner.host_tensors import int_tensor


@dataclass(frozen=True)
class PagedMetadata:
    slot_mapping: Slots  # [T]: where each new token's KV is written
    num_decode: int
    block_tables: torch.Tensor  # [num_decode, W] int32, padded with the null page
    lengths: torch.Tensor  # [num_decode] int32: tokens each decode row attends over
    prefills: tuple[PrefillSpan, ...]


def build_paged_metadata(layout: BatchLayout) -> PagedMetadata:
    if isinstance(layout.block_tables, np.ndarray):
        return _decode_only_metadata(layout)
    decode = layout.num_decode
    tables = layout.block_tables[:decode]
    lengths = [start + 1 for start in layout.starts[:decode]]
    size = layout.page_size
    counts = [-(-n // size) for n in lengths]
    width = max(max(counts, default=0), layout.table_width)
    new = [t[(n - 1) // size] * size + (n - 1) % size for t, n in zip(tables, lengths, strict=True)]
    slots, spans = prefill_spans(layout)
    flat = int_tensor(new)
    if slots:
        flat = torch.cat([flat, *slots])
    return PagedMetadata(
        Slots.of(flat, size),
        decode,
        _padded_tables(tables, counts, width, layout.null_page),
        int_tensor(lengths, torch.int32),
        spans,
    )


def _decode_only_metadata(layout: BatchLayout) -> PagedMetadata:
    """A step of decode rows whose tables come as one null-padded array: the new tokens'
    slots by a gather from it, no Python per row."""
    tables, size = layout.block_tables, layout.page_size
    last = np.array(layout.starts, dtype=np.int64)  # each row's new token: its position
    page = tables[np.arange(len(last)), last // size].astype(np.int64)
    if (page == layout.null_page).any():  # the null page must stay all zeros
        raise ValueError("a decode row's new token lies past its block table")
    slots = Slots(torch.from_numpy(page), torch.from_numpy(last % size))
    lengths = torch.from_numpy((last + 1).astype(np.int32))
    return PagedMetadata(slots, layout.num_decode, torch.from_numpy(tables), lengths, ())


def _padded_tables(tables, counts: list[int], width: int, null_page: int) -> torch.Tensor:
    """[rows, width] int32: each row's first `counts[i]` pages, then the null page. A small
    table is built from a list; a wide one (compiled steps pad to the longest context) by a
    few tensor ops, not a Python list of rows x width."""
    if len(tables) * width <= 4096:
        pad = (null_page,) * width
        rows = (tuple(t[:n]) + pad[n:] for t, n in zip(tables, counts, strict=True))
        return int_tensor(chain.from_iterable(rows), torch.int32).view(len(tables), width)
    out = torch.full((len(tables), width), null_page, dtype=torch.int32)
    pages = [p for t, n in zip(tables, counts, strict=True) for p in t[:n]]
    if pages:
        per_row = torch.tensor(counts)
        row = torch.repeat_interleave(torch.arange(len(tables)), per_row)
        first = torch.repeat_interleave(torch.cumsum(per_row, 0) - per_row, per_row)
        out[row, torch.arange(len(pages)) - first] = torch.tensor(pages, dtype=torch.int32)
    return out


def _write_decode(
    q: torch.Tensor,
    new: torch.Tensor,
    layer: PagedLayer,
    meta: PagedMetadata,
    v_part: int,
    v_dim: int,
    scale: float,
) -> torch.Tensor:
    """new [T, heads, parts, dim] written into the layer's pages, then the first B rows of the
    step (q [B, H, k_dim]) attended over theirs: one op (kernels/csrc/kv_write.cpp)."""
    slots = meta.slot_mapping
    return cpu_ops().paged_write_decode(
        q,
        new,
        layer.key,
        slots.page,
        slots.offset,
        meta.block_tables,
        meta.lengths,
        v_part,
        v_dim,
        scale,
    )


class PagedAttention:
    kind = "gqa"
    compilable = (
        True  # its decode rows are one op a compiled graph holds (engine/runner/compiled.py)
    )

    def build_metadata(self, layout: BatchLayout) -> PagedMetadata:
        return build_paged_metadata(layout)

    def forward(self, q, k, v, cache: GqaLayerKV, meta: PagedMetadata, scale: float):
        d = meta.num_decode
        decoded = _write_decode(
            q[:d], torch.stack((k, v), dim=-2), cache.layer, meta, 1, q.shape[-1], scale
        )
        if not meta.prefills:
            return decoded
        out = torch.empty_like(q)
        out[:d] = decoded
        for span in meta.prefills:
            out[span.begin : span.end] = TorchAttention._prefill(q, k, v, cache, span, scale)
        return out


class PagedMlaAttention:
    kind = "mla"
    compilable = True

    def build_metadata(self, layout: BatchLayout) -> PagedMetadata:
        return build_paged_metadata(layout)

    def forward(
        self, q_nope, q_pe, entry, cache: MlaLayerKV, meta: PagedMetadata, w: MlaWeights
    ) -> torch.Tensor:
        d, rank = meta.num_decode, w.kv_b.shape[1]
        q_latent = w.absorb(q_nope[:d])
        query = torch.cat((q_latent, q_pe[:d]), dim=-1)  # [B, H, rank + rope]
        latent = _write_decode(query, entry[:, None, None, :], cache.layer, meta, 0, rank, w.scale)
        decoded = w.expand(latent)
        if not meta.prefills:
            return decoded
        out = q_nope.new_empty(q_nope.shape[0], w.num_heads, w.v_dim)
        out[:d] = decoded
        for span in meta.prefills:
            rows = slice(span.begin, span.end)
            out[rows] = TorchMlaAttention._prefill(
                q_nope[rows], q_pe[rows], entry[rows], cache, span, w
            )
        return out
