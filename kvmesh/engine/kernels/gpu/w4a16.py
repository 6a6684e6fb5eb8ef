"""y = x W^T with W in kvmesh's group-wise INT4 (quant/int4.py: w = (q - 8) * scale + zero per
group of `group` input features), activations bf16 or fp32, as one Triton GEMM that unpacks the
nibbles in registers. The CUDA platform's INT4 linear; run on CPU under TRITON_INTERPRET=1 in
the tests.

Packed layout: [N, K / 2] bytes, feature 2j in the low nibble and 2j + 1 in the high one;
scale and zero [K / group, N] fp32. A program takes a BLOCK_M x BLOCK_N tile of y and walks K in
steps of BLOCK_K (a divisor of the group, so a step lies in one group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.engine.kernels.gpu.common import INTERPRETED, stored_as


@triton.jit
def _w4a16(
    x_ptr,
    stride_xm,
    w_ptr,
    scale_ptr,
    zero_ptr,
    y_ptr,
    stride_ym,
    M,
    N,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ks = tl.arange(0, BLOCK_K)
    shift = ((ks % 2) * 4).to(tl.uint8)[:, None]
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
            mask=row_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        # [BLOCK_K, BLOCK_N]: W^T's tile, each byte read for its two features
        packed = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * (K // 2) + ((k0 + ks) // 2)[:, None],
            mask=col_ok[None, :],
            other=0,
        )
        q = ((packed >> shift) & 15).to(tl.float32)
        group = k0 // GROUP
        scale = tl.load(scale_ptr + group * N + cols, mask=col_ok, other=0.0)
        zero = tl.load(zero_ptr + group * N + cols, mask=col_ok, other=0.0)
        w = (q - 8.0) * scale[None, :] + zero[None, :]
        if DOT_BF16:
            acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
        else:
            acc += tl.dot(x, w, input_precision="ieee")
    y = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y, stored_as(acc, y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> [N, K / 2] bytes, feature 2j low, 2j + 1 high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def w4a16(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype; W packed [N, K / 2], scale / zero [K / g, N]."""
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return y
    block_m = 16 if m <= 16 else 64
    block_k = min(group, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _w4a16[grid](
        x,
        x.stride(0),
        packed,
        scale,
        zero,
        y,
        y.stride(0),
        m,
        n,
        K=k,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=block_k,
        DOT_BF16=x.dtype == torch.bfloat16 and not INTERPRETED,
    )
    return y
