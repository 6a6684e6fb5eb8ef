"""The Triton backends (`--attention-backend triton`; the CUDA platform's default): the new
tokens' KV written by one kernel (kernels/gpu/kv_write.py, FP8 quantized inside), then every
row of a step, decode rows and prefill chunks alike, attended over its pages in place by one
kernel (kernels/gpu/attention.py) -- one launch for the decode rows (split over their pages when
they are few) and one for the chunks. MLA runs absorbed for every row: the query through W_UK,
one latent head over the cached entries, the output through W_UV.

On CPU tensors the kernels run under TRITON_INTERPRET=1 (slowly: tests and checks only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.engine.attention.base import BatchLayout, Slots
from kvmesh.engine.kernels.gpu.attention import AttentionPlan, paged_attention
from kvmesh.engine.kernels.gpu.kv_write import write_kv
from kvmesh.engine.layers.mla import MlaWeights
from kvmesh.engine.pool.kv_cache import GqaLayerKV, MlaLayerKV

BLOCK_Q = 16  # queries of a prefill chunk per program
MAX_SPLITS = 16  # programs per decode row over shares of its pages, at most
SPLIT_BELOW_ROWS = 32  # decode steps of fewer rows split their rows' pages


@dataclass(frozen=True)
class TritonMetadata:
    """Built on the host; `on(device)` copies it to the pages' device once per step."""

    slot_mapping: Slots  # [T]: where each new token's KV is written
    plans: tuple[AttentionPlan, ...]  # the decode rows' launch, then the chunks'
    moved: dict = field(default_factory=dict, compare=False)

    def static_copy(self, device: torch.device) -> TritonMetadata:
        """A copy of its own on `device`: a graph's metadata buffers (runner/graphs.py)."""
        slots = Slots(*(t.to(device, copy=True) for t in vars(self.slot_mapping).values()))
        return TritonMetadata(slots, tuple(p.to(device, clone=True) for p in self.plans))

    def copy_from(self, other: TritonMetadata) -> None:
        """Another step's metadata of the same shapes into this one's tensors."""
        if len(self.plans) != len(other.plans):
            raise ValueError("metadata of another launch shape")
        self.slot_mapping.page.copy_(other.slot_mapping.page, non_blocking=True)
        self.slot_mapping.offset.copy_(other.slot_mapping.offset, non_blocking=True)
        for mine, theirs in zip(self.plans, other.plans, strict=True):
            mine.copy_from(theirs)

    def on(self, device: torch.device) -> TritonMetadata:
        if device.type == "cpu":
            return self
        if device not in self.moved:
            slots = Slots(
                *(t.to(device, non_blocking=True) for t in vars(self.slot_mapping).values())
            )
            self.moved[device] = TritonMetadata(slots, tuple(p.to(device) for p in self.plans))
        return self.moved[device]


def build_triton_metadata(layout: BatchLayout) -> TritonMetadata:
    starts = np.asarray(layout.starts, dtype=np.int64)
    widths = np.asarray(layout.widths, dtype=np.int64)
    tables = _tables(layout, starts + widths)
    size = layout.page_size
    chunk = np.repeat(np.arange(len(widths)), widths)
    position = starts[chunk] + np.arange(len(chunk)) - np.repeat(np.cumsum(widths) - widths, widths)
    page = tables[chunk, position // size].astype(np.int64)
    slots = Slots(torch.from_numpy(page), torch.from_numpy(position % size))
    d = layout.num_decode
    plans = []
    if d:
        plans.append(_plan(tables[:d], starts[:d], widths[:d], 0, 1, _splits(tables[:d], d)))
    if len(widths) > d:
        plans.append(_plan(tables[d:], starts[d:], widths[d:], d, BLOCK_Q, 1))
    return TritonMetadata(slots, tuple(plans))


def _tables(layout: BatchLayout, lengths: np.ndarray) -> np.ndarray:
    """[chunks, W] int32 block tables, null-page padded past each chunk's pages."""
    if isinstance(layout.block_tables, np.ndarray):
        return layout.block_tables
    size = layout.page_size
    counts = -(-lengths // size)
    width = max(int(counts.max(initial=0)), layout.table_width, 1)
    out = np.full((len(lengths), width), layout.null_page, dtype=np.int32)
    for row, (table, count) in enumerate(zip(layout.block_tables, counts, strict=True)):
        out[row, :count] = table[:count]
    return out


def _splits(tables: np.ndarray, rows: int) -> int:
    if rows >= SPLIT_BELOW_ROWS:
        return 1
    pages = min(tables.shape[1], MAX_SPLITS)
    return 1 << (pages.bit_length() - 1)


def _plan(tables, starts, widths, begin: int, block_q: int, splits: int) -> AttentionPlan:
    blocks = -(-widths // block_q)
    block_chunk = np.repeat(np.arange(len(widths)), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    block_q0 = (np.arange(len(block_chunk)) - first) * block_q
    q_start = np.concatenate([[0], np.cumsum(widths)])
    return AttentionPlan(
        begin,
        begin + int(widths.sum()),
        torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int32)),
        *(torch.from_numpy(a.astype(np.int32)) for a in (q_start, starts + widths)),
        *(torch.from_numpy(a.astype(np.int32)) for a in (block_chunk, block_q0)),
        block_q,
        splits,
    )


class TritonAttention:
    kind = "gqa"
    compilable = False
    graphable = True  # fixed metadata shapes per bucket, no host waits (runner/graphs.py)

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        return build_triton_metadata(layout)

    def forward(self, q, k, v, cache: GqaLayerKV, meta: TritonMetadata, scale: float):
        layer = cache.layer
        meta = meta.on(layer.data.device)
        slots = meta.slot_mapping
        write_kv(torch.stack((k, v), dim=-2), slots.page, slots.offset, layer.data, layer.exps)
        out = torch.empty_like(q)
        for plan in meta.plans:
            paged_attention(q, layer.data, layer.exps, plan, 1, (q.shape[-1], 0), scale, out)
        return out


class TritonMlaAttention:
    kind = "mla"
    compilable = False
    graphable = True

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        return build_triton_metadata(layout)

    def forward(
        self, q_nope, q_pe, entry, cache: MlaLayerKV, meta: TritonMetadata, w: MlaWeights
    ) -> torch.Tensor:
        layer = cache.layer
        meta = meta.on(layer.data.device)
        slots = meta.slot_mapping
        write_kv(entry[:, None, None, :], slots.page, slots.offset, layer.data, layer.exps)
        rank, rope = w.kv_b.shape[1], q_pe.shape[-1]
        q_latent = w.absorb(q_nope)
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, rank + rope]
        latent = query.new_empty(*query.shape[:2], rank)
        for plan in meta.plans:
            paged_attention(query, layer.data, layer.exps, plan, 0, (rank, rope), w.scale, latent)
        return w.expand(latent)
