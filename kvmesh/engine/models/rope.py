"""Rotary position embeddings (HF rotate-half convention) with scaling variants."""

from __future__ import annotations

import math

import torch

from kvmesh.engine.config import ModelConfig, RopeScaling


def inv_frequencies(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_freqs is not None:  # GGUF carries llama3-style factors precomputed
        return inv / rope_freqs.float()
    return _scale(inv, config.rope_scaling)


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

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> None:
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
