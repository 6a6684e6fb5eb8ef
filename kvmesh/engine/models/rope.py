"""Rotary position embeddings (HF rotate-half convention) with scaling variants: linear, llama3
and yarn (whose attention factor scales cos and sin, as transformers does). Interleaved rotary
pairs (DeepSeek's `rope_interleave`) are `deinterleave`d first: the same numbers as rotating
pairs (x0, x1), (x2, x3), ... directly, in the order rotate-half expects."""

from __future__ import annotations

import math

import torch

from kvmesh.engine.config import ModelConfig, RopeScaling
from kvmesh.engine.platform import kernels_for


def inv_frequencies(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    dim = config.rope_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_freqs is not None:  # GGUF carries llama3-style factors precomputed
        return inv / rope_freqs.float()
    if config.rope_scaling.kind == "yarn":
        return _yarn(dim, config.rope_theta, config.rope_scaling)
    return _scale(inv, config.rope_scaling)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(s: RopeScaling) -> float:
    """What yarn multiplies cos and sin by (1 for the other kinds)."""
    if s.kind != "yarn":
        return 1.0
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def _yarn(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """Written as transformers computes it, so the floats agree bit for bit."""

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(s.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _scale(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    if s.kind == "linear":
        return inv / s.factor
    if s.kind != "llama3":
        return inv
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position once per step, shared by all layers."""

    def __init__(
        self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, factor: float = 1.0
    ) -> None:
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)

    @classmethod
    def of(
        cls,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        rope_freqs: torch.Tensor | None = None,
    ) -> RotaryEmbedding:
        factor = attention_factor(config.rope_scaling)
        return cls(inv_frequencies(config, rope_freqs), max_positions, dtype, factor)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos / sin [T, 1, D] (rotate-half form). On CPU, the C++ kernel
    (kernels/csrc/rope.cpp) gives the same bits as the torch expression in one pass."""
    if _kernel_fits(x, cos, sin):
        ops = kernels_for(x)
        if ops is not None:
            return ops.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _kernel_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        x.dim() == 3
        and x.stride(-1) == 1
        and x.dtype in (torch.float32, torch.bfloat16)
        and cos.dtype == x.dtype == sin.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.numel() == sin.numel() == x.shape[0] * x.shape[-1]
    )


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Dims (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...): interleaved rotary pairs as halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
