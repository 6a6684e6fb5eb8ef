"""Routed experts as grouped GEMMs (the fused_moe shape of vLLM and SGLang): the (token, choice)
pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M (`align`, torch ops
on the device: no host sync, a grid that depends on the batch size only), then one Triton GEMM
per projection whose programs each take BLOCK_M pairs of one expert times BLOCK_N outputs.

gate_up: pairs' token rows x W_gate_up[e]^T -> [pairs, 2I]; SiLU-mul in torch; down: x W_down[e]^T
times the pair's routing weight -> [pairs, H] fp32, summed over a token's choices in choice
order. Dense expert weights stacked [E, N, K] (K contiguous). Run on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.engine.kernels.gpu.common import INTERPRETED, stored_as

BLOCK_M = 16


@triton.jit
def _grouped_gemm(
    a_ptr,
    stride_am,  # [rows, K]: token rows (gate_up, A_ROW_DIV = top_k) or pair rows (down)
    b_ptr,
    stride_be,
    stride_bn,  # [E, N, K]
    c_ptr,
    stride_cm,  # [pairs, N]
    sorted_ptr,  # [bound]: pair ids by expert, runs padded with `pairs`
    block_expert_ptr,  # [bound / BLOCK_M]: each block's expert, -1 past the last run
    weight_ptr,  # [pairs] fp32 routing weights (MUL_WEIGHT)
    pairs,
    N,
    K: tl.constexpr,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pair = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        pair_ok = pair < pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + (pair // A_ROW_DIV)[:, None] * stride_am
        b_cols = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(
                a_rows + (k0 + ks)[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                b_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            if DOT_BF16:
                acc += tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
            else:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        if MUL_WEIGHT:
            acc *= tl.load(weight_ptr + pair, mask=pair_ok, other=0.0)[:, None]
        c = c_ptr + pair[:, None] * stride_cm + cols[None, :]
        tl.store(c, stored_as(acc, c_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def align(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pair ids sorted by expert, each expert's run padded to BLOCK_M with the
    pair count; each BLOCK_M block's expert, -1 for blocks past the last run). Sizes depend on
    T, k and the expert count only."""
    flat = ids.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount would wait for the host)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    blocks = triton.cdiv(pairs + num_experts * (BLOCK_M - 1), BLOCK_M)
    sorted_ids = torch.full((blocks * BLOCK_M,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[(ends - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=ids.device) * BLOCK_M
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, int],
    weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Each pair's row of `a` (a token row when a has T rows for T * k pairs) times its
    expert's b [E, N, K]^T -> [pairs, N]; times `weights` [pairs] when given.
    routing: (sorted pair ids, block experts, pairs) from `align`."""
    sorted_ids, block_expert, pairs = routing
    n, k = b.shape[1], b.shape[2]
    c = torch.empty(pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    grid = (len(block_expert), triton.cdiv(n, 64))
    _grouped_gemm[grid](
        a,
        a.stride(0),
        b,
        b.stride(0),
        b.stride(1),
        c,
        c.stride(0),
        sorted_ids,
        block_expert,
        weights if weights is not None else c,
        pairs,
        n,
        K=k,
        A_ROW_DIV=pairs // a.shape[0],
        MUL_WEIGHT=weights is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=64,
        BLOCK_K=32,
        DOT_BF16=a.dtype == torch.bfloat16 and not INTERPRETED,
    )
    return c
