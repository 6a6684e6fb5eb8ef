"""INT4 linears on the CUDA platform: kvmesh's group-wise INT4 as it is (no re-layout into a
vendor format), multiplied by the Triton W4A16 GEMM (kernels/gpu/w4a16.py). Checked on CPU
under TRITON_INTERPRET=1 and by scripts/device_check.py on a GPU."""

from __future__ import annotations

import torch

from kvmesh.engine.kernels.gpu.w4a16 import pack, w4a16
from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight, read_nibbles


class CudaInt4Linear:
    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.group, self.dtype = weight.group, dtype
        self.packed = pack(weight.q).to(device)
        self.scale = weight.scale.t().contiguous().to(device, torch.float32)
        self.zero = weight.zero.t().contiguous().to(device, torch.float32)

    @classmethod
    def from_cpu(cls, layer: Int4Linear, device: torch.device) -> CudaInt4Linear:
        """The same weights as a CPU INT4 linear (its 4-bit values read back from its packed
        blocks; its scales and zeros as it holds them, in the activation dtype)."""
        if not layer.can_read_rows:
            raise ValueError("this CPU INT4 layout cannot be read back")
        rows = torch.arange(layer.out_features)
        q = read_nibbles(layer.packed, layer.block, rows, layer.in_features)
        scales_zeros = layer.scales_zeros.float()  # [K / g, N, 2]
        weight = Int4Weight(
            q,
            scales_zeros[..., 0].t().contiguous(),
            scales_zeros[..., 1].t().contiguous(),
            layer.group,
        )
        return cls(weight, layer.scales_zeros.dtype, device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = w4a16(flat, self.packed, self.scale, self.zero, self.group)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes
