"""Grouped-query attention (MHA and MQA included) over GQA pages: fused q/k/v projection with
optional bias, optional per-head q/k RMSNorm (Qwen3, GLM), rotary on all of each head or on its
first `rotary_dim` dims (partial rotary, GLM)."""

from __future__ import annotations

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.layers.linear import Linear, LinearMethod
from kvmesh.engine.layers.norm import rms_norm
from kvmesh.engine.layers.weights import Weights
from kvmesh.engine.models.rope import apply_rotary


class GqaAttention:
    def __init__(
        self,
        config: ModelConfig,
        qkv: Linear,
        o_proj: Linear,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
    ) -> None:
        self.config, self.qkv, self.o_proj = config, qkv, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.rotary_dim = config.rope_dim

    @classmethod
    def load(
        cls, config: ModelConfig, weights: Weights, prefix: str, method: LinearMethod
    ) -> GqaAttention:
        """From `prefix`{q,k,v,o}_proj.weight (+ q/k/v biases, q_norm / k_norm)."""
        names = [f"{prefix}{n}_proj" for n in "qkv"]
        bias = None
        if config.attention_bias:
            bias = torch.cat([weights.dense(f"{n}.bias") for n in names])
        qkv = method.create([weights.raw(f"{n}.weight") for n in names], bias)
        o_bias = weights.optional(f"{prefix}o_proj.bias")
        o_proj = method.create([weights.raw(f"{prefix}o_proj.weight")], o_bias)
        q_norm = k_norm = None
        if config.qk_norm:
            q_norm, k_norm = (weights.dense(f"{prefix}{n}_norm.weight") for n in "qk")
        return cls(config, qkv, o_proj, q_norm, k_norm)

    def __call__(self, x, cos, sin, meta, cache, attention) -> torch.Tensor:
        c = self.config
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._position(q.view(-1, c.num_heads, c.head_dim), self.q_norm, cos, sin)
        k = self._position(k.view(-1, c.num_kv_heads, c.head_dim), self.k_norm, cos, sin)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        out = attention.forward(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _position(self, x, norm, cos, sin) -> torch.Tensor:
        if norm is not None:
            x = rms_norm(x, norm, self.config.rms_norm_eps)
        if self.rotary_dim == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        rot, rest = x.split([self.rotary_dim, x.shape[-1] - self.rotary_dim], dim=-1)
        return torch.cat((apply_rotary(rot, cos, sin), rest), dim=-1)

    @property
    def nbytes(self) -> int:
        norms = sum(n.nbytes for n in (self.q_norm, self.k_norm) if n is not None)
        return self.qkv.nbytes + self.o_proj.nbytes + norms
