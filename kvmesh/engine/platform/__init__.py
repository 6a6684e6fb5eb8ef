"""The platform seam: one `Platform` per engine, chosen once from `--device` (cpu | cuda |
auto), owning what is device-specific (base.py). Code that holds a tensor asks the platform of
the tensor's device (`for_device`, `kernels_for`) instead of testing `device.type` itself."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvmesh.engine.platform.base import Platform
from kvmesh.engine.platform.cpu import CpuPlatform

__all__ = ["Platform", "for_device", "kernels_for", "resolve"]
CPU = CpuPlatform()


def resolve(device: str) -> Platform:
    """The platform `--device` names: auto is CUDA where this process can run it, else CPU;
    cuda where it cannot is an InvalidRequestError naming the flag."""
    if device == "cpu":
        return CPU
    from kvmesh.engine.platform import cuda

    if device == "auto" and cuda.unavailable_reason() is not None:
        return CPU
    if device != "auto":
        cuda.check()
    return for_device(torch.device("cuda", torch.cuda.current_device()))


@functools.cache
def for_device(device: torch.device) -> Platform:
    """The platform whose tensors live on `device`."""
    if device.type == "cpu":
        return CPU
    if device.type == "cuda":
        from kvmesh.engine.platform.cuda import CudaPlatform

        return CudaPlatform(device.index or 0)
    raise ValueError(f"no kvmesh platform for {device.type} tensors")


def kernels_for(t: torch.Tensor) -> Any | None:
    """The kernel ops for tensors where `t` lives (None: the layers' torch path; also for a
    device no platform owns, e.g. meta tensors)."""
    if t.is_cpu:
        return CPU.kernels()
    return for_device(t.device).kernels() if t.is_cuda else None
