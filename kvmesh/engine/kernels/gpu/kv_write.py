"""The KV write as one Triton kernel: the new tokens' rows stored into their (page, offset)
slots of a layer's pages in place, FP8 rows quantized on the way (kv_fp8.py's exponent and
rounding: the same bytes as the torch codec). A program takes BLOCK_T tokens of one (head,
part)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.engine.kernels.gpu.common import stored_as
from kvmesh.engine.kernels.gpu.kv_fp8 import row_exponent, to_e4m3
from kvmesh.engine.kv.layout import EXP_MAX, EXP_MIN, FP8_MAX

BLOCK_T = 16


@triton.jit
def _write_rows(
    x_ptr,
    x_token,
    x_head,
    x_part,  # [T, heads, parts, D] new rows
    page_ptr,
    offset_ptr,  # [T]: each token's slot
    data_ptr,
    d_page,
    d_head,
    d_slot,
    d_part,  # the layer's data [pages, heads, slots, parts, D]
    e_ptr,
    e_page,
    e_head,
    e_slot,
    e_part,  # FP8: exponents [pages, heads, slots, parts]
    T,
    PARTS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FMAX: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX: tl.constexpr,
):
    block, row = tl.program_id(0), tl.program_id(1)
    head, part = row // PARTS, row % PARTS
    token = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_ok = token < T
    page = tl.load(page_ptr + token, mask=token_ok, other=0).to(tl.int64)
    offset = tl.load(offset_ptr + token, mask=token_ok, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    ok = token_ok[:, None] & (cols < D)
    src = x_ptr + token[:, None] * x_token + head * x_head + part * x_part + cols
    x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    at = (page * d_page + head * d_head + offset * d_slot + part * d_part)[:, None] + cols
    if FP8:
        k = row_exponent(tl.max(tl.abs(x), axis=1), FMAX, EMIN, EMAX)
        tl.store(data_ptr + at, to_e4m3(x, k[:, None]), mask=ok)
        exp_at = page * e_page + head * e_head + offset * e_slot + part * e_part
        tl.store(e_ptr + exp_at, k.to(tl.int8), mask=token_ok)
    else:
        tl.store(data_ptr + at, stored_as(x, data_ptr.dtype.element_ty), mask=ok)


def write_kv(
    x: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
    data: torch.Tensor,
    exps: torch.Tensor | None,
) -> None:
    """Rows x [T, heads, parts, D] into `data` [pages, heads, slots, parts, D] at (page[t],
    offset[t]) (FP8 pages: int8 e4m3 bits, with their exponents `exps`)."""
    if not x.shape[0]:
        return
    fp8 = exps is not None
    if fp8:
        data = data.view(torch.float8_e4m3fn)
    e = exps if fp8 else data  # never touched without FP8
    e_strides = exps.stride()[:4] if fp8 else (0, 0, 0, 0)
    heads, parts, dim = x.shape[1:]
    _write_rows[(triton.cdiv(x.shape[0], BLOCK_T), heads * parts)](
        x,
        *x.stride()[:3],
        page,
        offset,
        data,
        *data.stride()[:4],
        e,
        *e_strides,
        x.shape[0],
        PARTS=parts,
        D=dim,
        BLOCK_T=BLOCK_T,
        BLOCK_D=triton.next_power_of_2(dim),
        FP8=fp8,
        FMAX=FP8_MAX,
        EMIN=EXP_MIN,
        EMAX=EXP_MAX,
    )
