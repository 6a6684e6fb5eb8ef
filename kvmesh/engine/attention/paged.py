"""CPU backends that attend decode rows over the KV pages in place (kernels/csrc/paged_attention):
the step's plan is each decode row's block table and length; the kernel walks the pages, FP8
dequantized inside it, with no per-step gather of every context. Prefill chunks, few per step
and compute bound, go through the torch reference backends' paths.

Numerics: scores, softmax and the weighted sum in fp32 with an online softmax (the reference
rounds bf16 scores); outputs agree with the reference within rounding (tests/unit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.attention.base import BatchLayout, PrefillSpan, Slots
from kvmesh.engine.attention.metadata import prefill_spans
from kvmesh.engine.attention.torch_backend import TorchAttention
from kvmesh.engine.attention.torch_mla import TorchMlaAttention
from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.kv_cache import GqaLayerKV, MlaLayerKV, PagedLayer
from kvmesh.engine.layers.mla import MlaWeights


@dataclass(frozen=True)
class PagedMetadata:
    slot_mapping: Slots  # [T]: where each new token's KV is written
    num_decode: int
    block_tables: torch.Tensor  # [num_decode, W] int32, padded with the null page
    lengths: torch.Tensor  # [num_decode] int32: tokens each decode row attends over
    prefills: tuple[PrefillSpan, ...]


def build_paged_metadata(layout: BatchLayout) -> PagedMetadata:
    decode = layout.num_decode
    tables = layout.block_tables[:decode]
    lengths = [start + 1 for start in layout.starts[:decode]]
    width = max((-(-n // layout.page_size) for n in lengths), default=0)
    padded = [list(t[:width]) + [layout.null_page] * (width - len(t[:width])) for t in tables]
    size = layout.page_size
    new = [t[(n - 1) // size] * size + (n - 1) % size for t, n in zip(tables, lengths, strict=True)]
    slots, spans = prefill_spans(layout)
    flat = torch.cat([torch.tensor(new, dtype=torch.long), *slots])
    return PagedMetadata(
        Slots.of(flat, size),
        decode,
        torch.tensor(padded, dtype=torch.int32).view(decode, width),
        torch.tensor(lengths, dtype=torch.int32),
        spans,
    )


def _decode(q: torch.Tensor, layer: PagedLayer, meta: PagedMetadata, v_part: int, v_dim: int,
            scale: float) -> torch.Tensor:  # fmt: skip
    return cpu_ops().paged_decode(
        q.contiguous(), layer.data, layer.exps, meta.block_tables, meta.lengths, 0, v_part,
        v_dim, scale,
    )  # fmt: skip


class PagedAttention:
    kind = "gqa"

    def build_metadata(self, layout: BatchLayout) -> PagedMetadata:
        return build_paged_metadata(layout)

    def forward(self, q, k, v, cache: GqaLayerKV, meta: PagedMetadata, scale: float):
        cache.write(meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        d = meta.num_decode
        if d:
            out[:d] = _decode(q[:d], cache.layer, meta, 1, q.shape[-1], scale)
        for span in meta.prefills:
            out[span.begin : span.end] = TorchAttention._prefill(q, k, v, cache, span, scale)
        return out


class PagedMlaAttention:
    kind = "mla"

    def build_metadata(self, layout: BatchLayout) -> PagedMetadata:
        return build_paged_metadata(layout)

    def forward(self, q_nope, q_pe, entry, cache: MlaLayerKV, meta: PagedMetadata,
                w: MlaWeights) -> torch.Tensor:  # fmt: skip
        cache.write(meta.slot_mapping, entry)
        out = q_nope.new_empty(q_nope.shape[0], w.num_heads, w.v_dim)
        d = meta.num_decode
        if d:
            rank = w.kv_b.shape[1]
            q_latent = torch.bmm(q_nope[:d].transpose(0, 1), w.w_uk).transpose(0, 1)
            query = torch.cat((q_latent, q_pe[:d]), dim=-1)  # [B, H, rank + rope]
            latent = _decode(query, cache.layer, meta, 0, rank, w.scale)  # [B, H, rank]
            out[:d] = torch.bmm(latent.transpose(0, 1), w.w_uv.transpose(1, 2)).transpose(0, 1)
        for span in meta.prefills:
            rows = slice(span.begin, span.end)
            out[rows] = TorchMlaAttention._prefill(
                q_nope[rows], q_pe[rows], entry[rows], cache, span, w
            )
        return out
