"""Reference CPU backend for MLA latent pages (see layers/mla.py for the maths).

Decode rows: W_UK absorbed into the query, attention over the cached entries as one head (MQA,
qk dim rank + rope, v dim rank: the latent part of the same entries), W_UV applied to the
output. Prefill chunks: the context's latents expanded through kv_b_proj into per-head keys and
values, then standard causal attention (qk dim nope + rope, v dim v_head_dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.attention.base import AttentionMetadata, BatchLayout, PrefillSpan
from kvmesh.engine.attention.metadata import build_torch_metadata, offset_causal_mask
from kvmesh.engine.layers.mla import MlaWeights
from kvmesh.engine.pool.kv_cache import MlaLayerKV


class TorchMlaAttention:
    kind = "mla"
    compilable = False

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        return build_torch_metadata(layout)

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_pe: torch.Tensor,  # [T, H, rope], rotated
        entry: torch.Tensor,  # [T, rank + rope]: the new tokens' latent | rotated k_pe
        cache: MlaLayerKV,
        meta: AttentionMetadata,
        w: MlaWeights,
    ) -> torch.Tensor:  # [T, H, v]
        cache.write(meta.slot_mapping, entry)
        out = q_nope.new_empty(q_nope.shape[0], w.num_heads, w.v_dim)
        d = meta.num_decode
        if d:
            out[:d] = self._decode(q_nope[:d], q_pe[:d], cache, meta, w)
        for span in meta.prefills:
            rows = slice(span.begin, span.end)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], entry[rows], cache, span, w)
        return out

    @staticmethod
    def _decode(q_nope, q_pe, cache: MlaLayerKV, meta: AttentionMetadata, w: MlaWeights):
        rank = w.kv_b.shape[1]
        q_latent = w.absorb(q_nope)  # [B, H, rank]
        query = torch.cat((q_latent, q_pe), dim=-1)
        context = cache.read(meta.decode_gather)  # [B, L, rank + rope]
        scores = torch.bmm(query, context.transpose(1, 2)).float() * w.scale  # [B, H, L]
        mask = meta.decode_mask.view(scores.shape[0], 1, -1)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(query.dtype)
        latent = torch.bmm(probs, context[..., :rank])  # [B, H, rank]
        return w.expand(latent)

    @staticmethod
    def _prefill(q_nope, q_pe, entry, cache: MlaLayerKV, span: PrefillSpan, w: MlaWeights):
        rank = w.kv_b.shape[1]
        if span.gather_index is None:
            context, mask, causal = cache.as_stored(entry), None, True
        else:
            context = cache.read(span.gather_index)
            mask = offset_causal_mask(span.end - span.begin, span.context_start, q_nope.device)
            causal = False
        kv = F.linear(context[:, :rank], w.kv_b).view(len(context), w.num_heads, -1)
        k_nope, values = kv.split([w.nope_dim, w.v_dim], dim=-1)
        k_pe = context[:, None, rank:].expand(-1, w.num_heads, -1)
        keys = torch.cat((k_nope, k_pe), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=w.scale,
        )
        return out.squeeze(0).transpose(0, 1)
