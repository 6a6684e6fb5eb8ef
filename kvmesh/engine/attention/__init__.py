"""Attention backends behind one interface, chosen by name and KV kind from a registry."""

from __future__ import annotations

from kvmesh.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    PrefillSpan,
    Slots,
)
from kvmesh.engine.platform import CPU, Platform
from kvmesh.errors import InvalidRequestError

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BatchLayout",
    "PrefillSpan",
    "Slots",
    "get_backend",
]

# (name, KV kind) -> "module:class", imported on first use
_BACKENDS = {
    ("torch", "gqa"): "kvmesh.engine.attention.torch_backend:TorchAttention",
    ("torch", "mla"): "kvmesh.engine.attention.torch_mla:TorchMlaAttention",
    ("cpu", "gqa"): "kvmesh.engine.attention.paged:PagedAttention",
    ("cpu", "mla"): "kvmesh.engine.attention.paged:PagedMlaAttention",
    ("triton", "gqa"): "kvmesh.engine.attention.triton_paged:TritonAttention",
    ("triton", "mla"): "kvmesh.engine.attention.triton_paged:TritonMlaAttention",
    ("flashinfer", "gqa"): "kvmesh.engine.attention.flashinfer_backend:FlashInferAttention",
    ("flashinfer", "mla"): "kvmesh.engine.attention.flashinfer_mla:FlashInferMlaAttention",
}


def get_backend(name: str, kind: str = "gqa", platform: Platform = CPU) -> AttentionBackend:
    """The backend `--attention-backend NAME` means on `platform` for layers of `kind`."""
    name = platform.attention_backend(name)
    if name == "cpu":
        from kvmesh.engine.kernels import cpu_ops

        if cpu_ops() is None:
            raise InvalidRequestError("attention backend 'cpu' needs the CPU kernels (see logs)")
    target = _BACKENDS.get((name, kind))
    if target is None:
        have = sorted(f"{n}/{k}" for n, k in _BACKENDS)
        raise InvalidRequestError(f"no attention backend {name!r} for {kind} KV; have {have}")
    import importlib

    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()
