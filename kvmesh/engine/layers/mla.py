"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, GLM 5).

Per token the layer caches one entry: the normalized `kv_lora_rank` latent c and the rotated
shared key k_pe (`qk_rope_head_dim`), i.e. MLA latent pages. Keys and values of head h are
k_h = [W_UK_h c, k_pe] and v_h = W_UV_h c, where W_UK / W_UV are the two halves of `kv_b_proj`.
The backend either expands the latents through kv_b_proj (prefill: standard attention with qk
dim nope + rope and v dim `v_head_dim`) or absorbs W_UK into the query and W_UV into the output
(decode: one-head attention over the latent pages). The softmax scale is qk_head_dim^-0.5, times
yarn's mscale(factor, mscale_all_dim)^2 under yarn rope -- not (kv_lora_rank + rope)^-0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.layers.linear import Linear, LinearMethod
from kvmesh.engine.layers.norm import rms_norm
from kvmesh.engine.layers.weights import Weights
from kvmesh.engine.models.rope import apply_rotary, deinterleave, yarn_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not rms_norm_eps


@dataclass(frozen=True)
class MlaWeights:
    """What an MLA backend needs besides the query and the cache: kv_b_proj [H*(nope+v), rank]
    (viewed per head for absorption), the head dims and the softmax scale."""

    kv_b: torch.Tensor
    num_heads: int
    nope_dim: int
    v_dim: int
    scale: float

    @property
    def per_head(self) -> torch.Tensor:
        """[H, nope + v, rank]."""
        return self.kv_b.view(self.num_heads, self.nope_dim + self.v_dim, -1)

    @property
    def w_uk(self) -> torch.Tensor:
        return self.per_head[:, : self.nope_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        return self.per_head[:, self.nope_dim :]

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, rank]: W_UK folded into the query (attention over latents)."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def expand(self, latent: torch.Tensor) -> torch.Tensor:
        """[T, H, rank] -> [T, H, v]: an absorbed attention's output through W_UV."""
        return torch.bmm(latent.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)


def softmax_scale(config: ModelConfig) -> float:
    mla, rope = config.mla, config.rope_scaling
    assert mla is not None
    scale = mla.qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class MlaAttention:
    def __init__(self, config: ModelConfig, proj: dict, norms: dict, mla: MlaWeights) -> None:
        self.config, self.proj, self.norms, self.weights = config, proj, norms, mla
        assert config.mla is not None
        self.dims = config.mla

    @classmethod
    def load(
        cls, config: ModelConfig, weights: Weights, prefix: str, method: LinearMethod
    ) -> MlaAttention:
        """From `prefix`{q_a_proj, q_a_layernorm, q_b_proj | q_proj}, kv_a_proj_with_mqa,
        kv_a_layernorm, kv_b_proj, o_proj (biases where the checkpoint has them)."""
        mla = config.mla
        assert mla is not None

        def linear(name: str) -> Linear:
            bias = weights.optional(f"{prefix}{name}.bias")
            return method.create([weights.raw(f"{prefix}{name}.weight")], bias)

        names = ["q_a_proj", "q_b_proj"] if mla.q_lora_rank else ["q_proj"]
        proj = {n: linear(n) for n in [*names, "kv_a_proj_with_mqa", "o_proj"]}
        norms = {n: weights.dense(f"{prefix}{n}.weight") for n in ("kv_a_layernorm",)}
        if mla.q_lora_rank:
            norms["q_a_layernorm"] = weights.dense(f"{prefix}q_a_layernorm.weight")
        kv_b = weights.dense(f"{prefix}kv_b_proj.weight")
        heads = config.num_heads
        mla_weights = MlaWeights(
            kv_b, heads, mla.qk_nope_head_dim, mla.v_head_dim, softmax_scale(config)
        )
        return cls(config, proj, norms, mla_weights)

    def __call__(self, x, cos, sin, meta, cache, attention) -> torch.Tensor:
        c, d = self.config, self.dims
        if d.q_lora_rank:
            q = self.proj["q_b_proj"](self._norm(self.proj["q_a_proj"](x), "q_a_layernorm"))
        else:
            q = self.proj["q_proj"](x)
        q_nope, q_pe = q.view(-1, c.num_heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1
        )
        latent, k_pe = self.proj["kv_a_proj_with_mqa"](x).split(
            [d.kv_lora_rank, d.qk_rope_head_dim], dim=-1
        )
        q_pe, k_pe = self._rotate(q_pe, cos, sin), self._rotate(k_pe.unsqueeze(1), cos, sin)
        entry = torch.cat((self._norm(latent, "kv_a_layernorm"), k_pe.squeeze(1)), dim=-1)
        out = attention.forward(q_nope, q_pe, entry, cache, meta, self.weights)
        return self.proj["o_proj"](out.reshape(-1, c.num_heads * d.v_head_dim))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.norms[name], LATENT_NORM_EPS)

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        if self.config.rope_interleave:
            x = deinterleave(x)
        return apply_rotary(x, cos, sin)

    @property
    def nbytes(self) -> int:
        held = sum(p.nbytes for p in self.proj.values()) + self.weights.kv_b.nbytes
        return held + sum(n.nbytes for n in self.norms.values())
