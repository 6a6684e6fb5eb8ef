"""Reference CPU backend for GQA pages: torch SDPA with native GQA over gathered pages.

Decode rows are attended as one padded batch (no per-sequence Python loop); prefill chunks,
which are few per step, one SDPA call each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.attention.base import AttentionMetadata, BatchLayout, PrefillSpan
from kvmesh.engine.attention.metadata import build_torch_metadata, offset_causal_mask
from kvmesh.engine.pool.kv_cache import GqaLayerKV


class TorchAttention:
    kind = "gqa"
    compilable = False

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        return build_torch_metadata(layout)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: GqaLayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        cache.write(meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], cache, meta, scale)
        for span in meta.prefills:
            out[span.begin : span.end] = self._prefill(q, k, v, cache, span, scale)
        return out

    @staticmethod
    def _decode(q, cache: GqaLayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        keys, values = cache.read(meta.decode_gather)  # [B, L, Hkv, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if q.dtype != torch.float32:  # CPU SDPA with a mask falls back to a slow path off fp32
            return _grouped_decode(q, keys, values, meta.decode_mask, scale)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(q, k, v, cache: GqaLayerKV, span: PrefillSpan, scale: float) -> torch.Tensor:
        query = q[span.begin : span.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if span.gather_index is None:
            keys, values = cache.as_stored(k[span.begin : span.end], v[span.begin : span.end])
            mask, causal = None, True
        else:
            keys, values = cache.read(span.gather_index)
            mask, causal = (
                offset_causal_mask(span.end - span.begin, span.context_start, q.device),
                False,
            )
        out = F.scaled_dot_product_attention(
            query,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)


def _grouped_decode(q, keys, values, mask, scale: float) -> torch.Tensor:
    """One query per row, GQA by grouping query heads per KV head; softmax in fp32."""
    batch, num_heads, dim = q.shape
    num_kv = keys.shape[1]
    grouped = q.view(batch, num_kv, num_heads // num_kv, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill(~mask.view(batch, 1, 1, -1), float("-inf")).softmax(-1)
    return torch.matmul(probs.to(q.dtype), values).view(batch, num_heads, dim)
