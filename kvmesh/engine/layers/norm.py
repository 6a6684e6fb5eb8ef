"""RMSNorm as the HF models compute it: in fp32, scaled by the weight in the input dtype.

bf16 rows on CPU go through the C++ kernel (kernels/csrc/norm.cpp), which gives the same bits
as the torch expression below in one pass instead of about ten ops; fp32 rows go through the
same op, which runs torch's fused rms_norm for them (the kernel's reduction order differs), so a
compiled step keeps eager's bits either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.platform import kernels_for


def _kernel_for(x: torch.Tensor, weight: torch.Tensor):
    if x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == x.dtype and x.is_contiguous():
        return kernels_for(x)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = _kernel_for(x, weight)
    if ops is not None:
        return ops.rms_norm(x.view(-1, x.shape[-1]), weight, eps).view(x.shape)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + delta), h + delta): a residual add and the next norm in one pass."""
    ops = _kernel_for(h, weight)
    if ops is not None and delta.is_contiguous() and delta.dtype == h.dtype:
        shape = h.shape
        normed, total = ops.add_rms_norm(
            h.view(-1, shape[-1]), delta.view(-1, shape[-1]), weight, eps
        )
        return normed.view(shape), total.view(shape)
    total = h + delta
    return rms_norm(total, weight, eps), total
