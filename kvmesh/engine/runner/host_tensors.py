"""Integer tensors built from Python lists on the host, once per step on the hot path.

`torch.tensor(list)` converts element by element (the page ids of 64 running contexts are
about 1,100); packing the list into an `array` first and viewing its buffer is several times
faster, and an unsigned code faster again (its items convert in C, not through a generic
argument parse). Measured in docs/benchmarks-history.md, "A Xeon without AMX: bf16 linears in
register tiles, attention in registers, host work, prefill threads" and "INT4 on AVX2, argmax
and host work". The tensor shares the array's memory and keeps it alive.
"""

from __future__ import annotations

import array
from collections.abc import Iterable

import torch

_UNSIGNED = {torch.int64: "Q", torch.int32: "I"}  # a fast C conversion per item
_SIGNED = {torch.int64: "q", torch.int32: "i"}  # a generic argument parse per item: slower
for _code in (*_UNSIGNED.values(), *_SIGNED.values()):
    assert array.array(_code).itemsize in (4, 8)


def int_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D int64 / int32 CPU tensor of `values`. Non-negative values (the usual: ids,
    positions, pages) go through the unsigned array codes, whose bit patterns are the signed
    ones below 2**63 / 2**31 (values above those are not ids); a negative value falls back."""
    if not isinstance(values, list | tuple | array.array):
        values = list(values)
    try:
        return _view(array.array(_UNSIGNED[dtype], values), dtype)
    except OverflowError:
        return _view(array.array(_SIGNED[dtype], values), dtype)


def uint32_bits(values: Iterable[int]) -> torch.Tensor:
    """uint32 values (integrity tags) as the int32 tensor of the same bit patterns."""
    return _view(array.array("I", values), torch.int32)


def _view(buffer: array.array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
