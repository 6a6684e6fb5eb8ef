"""INT4 linears on the CUDA platform: kvmesh's group-wise INT4 as it is (no re-layout into a
vendor format), multiplied by the Triton W4A16 GEMM (kernels/gpu/w4a16.py). Checked on CPU
under TRITON_INTERPRET=1 and by scripts/device_check.py on a GPU."""

from __future__ import annotations

import torch

from kvmesh.engine.kernels.gpu.w4a16 import pack, w4a16
from kvmesh.engine.quant.int4 import Int4Weight


class CudaInt4Linear:
    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.group, self.dtype = weight.group, dtype
        self.packed = pack(weight.q).to(device)
        self.scale = weight.scale.t().contiguous().to(device, torch.float32)
        self.zero = weight.zero.t().contiguous().to(device, torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = w4a16(flat, self.packed, self.scale, self.zero, self.group)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes
