"""What every Triton kernel of kvmesh shares: whether they run under the interpreter, and the
casts whose rounding the interpreter gets wrong."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# TRITON_INTERPRET=1 (read at import, as triton reads it): kernels on CPU tensors, each program
# in numpy; bf16 dot operands would be multiplied as raw 16-bit words there, so dots run in fp32
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def stored_as(x, dtype: tl.constexpr):
    """fp32 x cast to `dtype` as torch casts (to nearest, ties to even): the interpreter
    truncates fp32 -> bf16, so bf16 is rounded in fp32 bits first (then the cast is exact)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
