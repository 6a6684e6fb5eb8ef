"""INT4 linears on CUDA: torch's tinygemm kernel (`_weight_int4pack_mm`) over kvmesh's
group-wise (scale, zero) INT4, bf16 activations. Run only by the GPU tests (tests/unit/test_int4.py
skips without CUDA; scripts/device_check.py runs them)."""

from __future__ import annotations

import torch

from kvmesh.engine.quant.int4 import Int4Weight, scales_zeros_of


class CudaInt4Linear:
    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.group = weight.group
        q = weight.q.to(device)
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # even k in the high nibble
        tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
        self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
        self.scales_zeros = scales_zeros_of(weight, dtype, device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group, self.scales_zeros)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes
