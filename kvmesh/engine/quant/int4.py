"""INT4 weight-only, group-wise, asymmetric: w ~= (q - 8) * scale + zero, q in 0..15, one
(scale, zero) per `group` consecutive input features of each output row -- torch's tinygemm
convention, so the CPU kernel `_weight_int4pack_mm_for_cpu` consumes it as is.

Sources: round-to-nearest from float weights (min/max per group), or GGUF Q4_1 / Q4_0 blocks
taken over exactly: a Q4_1 block of 32 is w = d * q + m, i.e. scale = d, zero = m + 8 d (Q4_0:
w = d * (q - 8), zero = 0) -- no dequantize-requantize round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // group] float32
    zero: torch.Tensor  # [N, K // group] float32
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the weight the kernel multiplies by."""
        n, k = self.shape
        q = self.q.float().view(n, k // self.group, self.group)
        return ((q - 8) * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k)

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int = 32) -> Int4Weight:
        """Round-to-nearest, asymmetric min/max per group."""
        n, k = w.shape
        if k % group:
            raise ValueError(f"input features {k} are not a multiple of the group size {group}")
        wg = w.float().view(n, k // group, group)
        low, high = wg.amin(-1), wg.amax(-1)
        scale = ((high - low) / 15).clamp_min(1e-10)
        q = ((wg - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
        return cls(q.to(torch.uint8).view(n, k), scale, low + 8 * scale, group)

    @classmethod
    def from_gguf_blocks(cls, raw: np.ndarray, qtype: str, rows: int, cols: int) -> Int4Weight:
        """GGUF Q4_1 (d, m, 16 bytes of nibbles) or Q4_0 (d, nibbles) blocks of 32, row-major."""
        block = {"Q4_1": 20, "Q4_0": 18}[qtype]
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, block)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if qtype == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            nibbles = blocks[..., 4:]
        else:
            m = -8.0 * d
            nibbles = blocks[..., 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # value j, then j + 16
        scale = torch.from_numpy(d)
        return cls(torch.from_numpy(q.reshape(rows, cols).astype(np.uint8)), scale,
                   torch.from_numpy(m) + 8 * scale, 32)  # fmt: skip

    def rows(self, order: torch.Tensor) -> Int4Weight:
        """The same weight with its output rows reordered (e.g. llama.cpp's Q/K permutation)."""
        return Int4Weight(self.q[order], self.scale[order], self.zero[order], self.group)

    @staticmethod
    def cat(parts: Sequence[Int4Weight]) -> Int4Weight:
        """Stack output rows (fused QKV / gate-up); the groups run along inputs, unaffected."""
        groups = {p.group for p in parts}
        if len(groups) != 1:
            raise ValueError(f"cannot fuse INT4 weights of group sizes {sorted(groups)}")
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), groups.pop())  # fmt: skip


class Int4Linear:
    """y = x W^T with W in INT4, activations fp32 or bf16 (CPU: torch's tinygemm kernel)."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        self.out_features, self.in_features = weight.shape
        self.group = weight.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.q.to(torch.int32), 1
        )
        scales_zeros = torch.stack([weight.scale, weight.zero], dim=-1)  # [N, K/g, 2]
        self.scales_zeros = scales_zeros.transpose(0, 1).contiguous().to(dtype)  # [K/g, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.group, self.scales_zeros
        )
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes
