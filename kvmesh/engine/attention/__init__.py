"""Attention backends behind one interface, chosen by name from a registry."""

from __future__ import annotations

from kvmesh.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    LayerKV,
    PrefillSpan,
    Slots,
)
from kvmesh.engine.attention.torch_backend import TorchAttention
from kvmesh.errors import InvalidRequestError

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "LayerKV",
    "PrefillSpan",
    "Slots",
    "get_backend",
]

_BACKENDS: dict[str, type] = {"torch": TorchAttention}


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise InvalidRequestError(f"unknown attention backend {name!r}; have {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
