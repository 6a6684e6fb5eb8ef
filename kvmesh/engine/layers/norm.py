"""RMSNorm as the HF models compute it: in fp32, scaled by the weight in the input dtype.

bf16 rows on CPU go through the C++ kernel (kernels/csrc/norm.cpp), which gives the same bits
as the torch expression below in one pass instead of about ten ops; fp32 stays on torch's fused
op, whose reduction order the kernel does not reproduce bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.kernels import cpu_ops


def _kernel_for(x: torch.Tensor):
    if x.dtype is torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous():
        return cpu_ops()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = _kernel_for(x)
    if ops is not None and weight.dtype is torch.bfloat16:
        return ops.rms_norm(x.view(-1, x.shape[-1]), weight, eps, None)[0].view(x.shape)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + delta), h + delta): a residual add and the next norm in one pass."""
    ops = _kernel_for(h)
    if ops is not None and delta.is_contiguous() and delta.dtype is torch.bfloat16:
        shape = h.shape
        normed, total = ops.rms_norm(h.view(-1, shape[-1]), weight, eps, delta.view(-1, shape[-1]))
        return normed.view(shape), total.view(shape)
    total = h + delta
    return rms_norm(total, weight, eps), total
