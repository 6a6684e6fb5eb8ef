"""Integer tensors built from Python lists on the host, once per step on the hot path.

`torch.tensor(list)` converts element by element (~100 ns each: ~110 us for the ~1,100 page ids
of 64 running contexts); packing the list into an `array` first and viewing its buffer is ~3x
faster (docs/benchmarks.md). The tensor shares the array's memory and keeps it alive.
"""

from __future__ import annotations

import array
from collections.abc import Iterable

import torch

_CODES = {torch.int64: "q", torch.int32: "i"}
assert array.array("q").itemsize == 8 and array.array("i").itemsize == 4
assert array.array("I").itemsize == 4


def int_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D int64 / int32 CPU tensor of `values`."""
    return _view(array.array(_CODES[dtype], values), dtype)


def uint32_bits(values: Iterable[int]) -> torch.Tensor:
    """uint32 values (integrity tags) as the int32 tensor of the same bit patterns."""
    return _view(array.array("I", values), torch.int32)


def _view(buffer: array.array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
