"""Attention backends behind one interface, chosen by name and KV kind from a registry."""

from __future__ import annotations

from kvmesh.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    PrefillSpan,
    Slots,
)
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
}


def resolve(name: str, device: str = "cpu") -> str:
    """`auto`: the paged CPU kernels where they run (kernels/build.py), else the torch ones."""
    if name != "auto":
        return name
    from kvmesh.engine.kernels import cpu_ops

    return "cpu" if device == "cpu" and cpu_ops() is not None else "torch"


def get_backend(name: str, kind: str = "gqa") -> AttentionBackend:
    name = resolve(name)
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
