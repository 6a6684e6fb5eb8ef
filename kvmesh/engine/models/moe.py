"""Mixture-of-experts decoders: Qwen3-MoE (GQA + q/k norm, softmax routing), DeepSeek-V3 and
Kimi K2 (MLA, sigmoid group-limited routing with a correction bias, shared experts, the first
layers dense), GLM-4.5/4.6 (GQA with partial rotary, q/k/v bias, optional q/k norm, DeepSeek
routing), GLM-4.7-Flash (MLA + GLM routing) and GLM 5 (`GlmMoeDsa`: MLA + DeepSeek Sparse
Attention). Which layers are MoE and how they route comes from the config (MoeConfig).

GLM 5's lightning indexer picks each query's `index_topk` best keys; while a sequence is no
longer than index_topk every key is picked and DSA is exactly dense MLA, which is what runs
here: the engine caps such a model's context at index_topk (engine.py) and the indexer's
weights are read and set aside.
"""

from __future__ import annotations

from typing import Any

from kvmesh.engine.layers.gqa import GqaAttention
from kvmesh.engine.layers.mla import MlaAttention
from kvmesh.engine.layers.moe import MoE
from kvmesh.engine.models.base import DecoderModel


class MoeModel(DecoderModel):
    def attention(self, index: int, prefix: str) -> Any:
        if self.config.mla is None:
            return GqaAttention.load(self.config, self.weights, prefix, self.method)
        if self.config.indexer is not None:
            for name in [n for n in self.weights.state if n.startswith(f"{prefix}indexer.")]:
                self.weights.raw(name)  # dense-equivalent DSA: see the module docstring
        return MlaAttention.load(self.config, self.weights, prefix, self.method)

    def mlp(self, index: int, prefix: str) -> Any:
        moe = self.config.moe
        if moe is None or index not in moe.layers:
            return super().mlp(index, prefix)
        return MoE.load(moe, self.weights, f"{prefix}mlp.", self.method)
