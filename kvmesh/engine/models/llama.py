"""Llama-family decoders on GQA pages: Llama 2/3, SmolLM2, Qwen2, Mistral, and Qwen3 (per-head
q/k RMSNorm, from the config). Q/K/V and gate/up are fused at load time into one matmul each."""

from __future__ import annotations

from kvmesh.engine.layers.gqa import GqaAttention
from kvmesh.engine.models.base import DecoderModel


class LlamaModel(DecoderModel):
    def attention(self, index: int, prefix: str) -> GqaAttention:
        return GqaAttention.load(self.config, self.weights, prefix, self.method)
