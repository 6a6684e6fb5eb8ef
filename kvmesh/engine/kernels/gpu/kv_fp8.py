"""FP8 KV codec as Triton kernels, for CUDA tensors (same format as pool/kv_fp8.py, byte for byte).

One program per (token, head) row of `head_dim` values: amax, power-of-two exponent, scale and
cast in one pass, instead of the half-dozen elementwise kernels the torch codec launches. Tested
on CPU under TRITON_INTERPRET=1. The interpreter (triton 3.7-3.9) rounds fp32 -> e4m3 wrongly
when rounding carries into the exponent, so values are first rounded onto the e4m3 grid in fp32
(ties to even) -- the cast is then exact on the interpreter and on hardware alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.engine.kv.layout import EXP_MAX, EXP_MIN, FP8_MAX


@triton.jit
def _round_to_e4m3_grid(x):
    ax = tl.abs(x)
    e = ((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)  # below 2**-6 the e4m3 grid is the subnormal one: ulp 2**-9
    ulp = tl.exp2((e - 3).to(tl.float32))
    v = ax / ulp
    r = tl.floor(v + 0.5)
    r = tl.where(((r - v) == 0.5) & ((r % 2.0) == 1.0), r - 1.0, r)  # ties to even
    q = tl.minimum(r * ulp, 448.0)
    return tl.where(x < 0, -q, q)


@triton.jit
def _quantize_rows(
    x_ptr, q_ptr, e_ptr, D: tl.constexpr, FMAX: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + row * D + cols).to(tl.float32)
    k = row_exponent(tl.max(tl.abs(x), axis=0), FMAX, EMIN, EMAX)
    tl.store(q_ptr + row * D + cols, to_e4m3(x, k))
    tl.store(e_ptr + row, k.to(tl.int8))


@triton.jit
def row_exponent(amax, FMAX: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr):
    """The power of two a row of largest magnitude `amax` is stored under: frexp's exponent of
    amax / FMAX (m * 2**k, m in [0.5, 1); 0 for a zero row, as torch.frexp), in [EMIN, EMAX]."""
    ratio = amax / FMAX
    k = ((ratio.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    k = tl.where(ratio == 0.0, 0, k)
    return tl.minimum(tl.maximum(k, EMIN), EMAX)


@triton.jit
def to_e4m3(x, k):
    """x / 2**k as e4m3 values, rounded as torch's cast rounds."""
    return _round_to_e4m3_grid(x * tl.exp2((-k).to(tl.float32))).to(tl.float8e4nv)


@triton.jit
def _dequantize_rows(q_ptr, e_ptr, out_ptr, D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + row * D + cols).to(tl.float32)
    scale = tl.exp2(tl.load(e_ptr + row).to(tl.float32))
    tl.store(out_ptr + row * D + cols, (q * scale).to(out_ptr.dtype.element_ty))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As kv_fp8.quantize: x [..., D] (D a power of two) -> (q int8 [..., D], e int8 [...])."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    e = torch.empty(rows.shape[0], dtype=torch.int8, device=x.device)
    if rows.shape[0]:
        _quantize_rows[(rows.shape[0],)](rows, q, e, rows.shape[1], FP8_MAX, EXP_MIN, EXP_MAX)
    return q.view(torch.int8).view(x.shape), e.view(x.shape[:-1])


def dequantize(q: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As kv_fp8.dequantize: exactly q * 2**e, in `dtype`."""
    rows = q.reshape(-1, q.shape[-1]).contiguous().view(torch.float8_e4m3fn)
    out = torch.empty(rows.shape, dtype=dtype, device=q.device)
    if rows.shape[0]:
        _dequantize_rows[(rows.shape[0],)](rows, e.reshape(-1).contiguous(), out, rows.shape[1])
    return out.view(q.shape)
