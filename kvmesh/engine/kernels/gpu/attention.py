"""Paged attention over kvmesh's pages in place, as Triton kernels (the CUDA platform's backend;
run on CPU tensors under TRITON_INTERPRET=1 in the tests).

One kernel for decode rows, prefill chunks and chunks over a cached prefix (vLLM's unified
attention is the model): a program takes a block of BLOCK_Q query positions of one chunk times
BLOCK_H of the GROUP query heads of one KV head (all of them unless its accumulator would
outgrow a GPU's registers: MLA's 128 heads), and walks the chunk's pages through its block table, one
page per iteration, with an online softmax. Pages are read through four explicit strides (page,
head, slot, part; the dim stride is 1), so a layer's view of the pool is read where it lies.

What a layer caches per slot: GQA, K (part 0) and V (part 1) of `DA` values; MLA, one entry of
`DA` latent + `DB` rope values whose latent part is also the value (W_UK/W_UV absorbed in torch,
as today). FP8 pages hold e4m3 values with a power-of-two exponent per (slot, head, part): the
scores' columns are scaled by 2**eK and the probabilities' columns by 2**eV before P.V -- exact,
and the softmax sums come from the unscaled P.

Long decode contexts are split over SPLITS programs per row (split-K), each a share of the pages,
merged by `_merge_splits`. Maths in fp32 after every load (the interpreter keeps bf16 as raw
16-bit words); tl.dot's operands are fp32 (`ieee`, no tf32) unless DOT_BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvmesh.engine.kernels.gpu.common import INTERPRETED, stored_as

LOG2E = 1.4426950408889634
ACC_ELEMENTS = 16 * 512  # a program's fp32 accumulator at most (registers on a GPU)
NEG = -1.0e38  # a running max that is not -inf: a split or tile without keys adds exactly 0


@dataclass(frozen=True)
class AttentionPlan:
    """One launch's work: rows [begin, end) of the step, in chunks of consecutive query rows
    (a decode row is a chunk of one), each with its block table and length; programs take
    `block_q` queries of one chunk (`block_chunk`, `block_q0`). int32 tensors on the pages'
    device; `q_start` relative to `begin`."""

    begin: int
    end: int
    tables: torch.Tensor  # [chunks, W], null-page padded
    q_start: torch.Tensor  # [chunks + 1]
    seq_lens: torch.Tensor  # [chunks]: tokens cached after the step, the chunk's included
    block_chunk: torch.Tensor  # [programs]
    block_q0: torch.Tensor  # [programs]
    block_q: int
    splits: int  # programs per block over shares of its pages (a power of two)

    def to(self, device: torch.device, clone: bool = False) -> AttentionPlan:
        """This plan with its tensors on `device` (`clone`: always new ones)."""
        if self.tables.device == device and not clone:
            return self
        move = {
            name: getattr(self, name).to(device, non_blocking=True, copy=clone) for name in _TENSORS
        }
        return AttentionPlan(self.begin, self.end, block_q=self.block_q, splits=self.splits, **move)

    def copy_from(self, other: AttentionPlan) -> None:
        """Another step's plan into this one's tensors (a graph's buffers): the same launch."""
        if (self.begin, self.end, self.block_q, self.splits) != (
            other.begin,
            other.end,
            other.block_q,
            other.splits,
        ):
            raise ValueError("a plan of another launch shape")
        for name in _TENSORS:
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)


_TENSORS = ("tables", "q_start", "seq_lens", "block_chunk", "block_q0")


@triton.jit
def _paged_attention(
    q_ptr,
    stride_qt,
    stride_qh,  # [T, Hq, DA + DB]
    kv_ptr,
    s_page,
    s_head,
    s_slot,
    s_part,  # the layer's data [pages, heads, slots, parts, dim]
    e_ptr,
    e_page,
    e_head,
    e_slot,
    e_part,  # FP8 exponents [pages, heads, slots, parts]
    tables_ptr,
    stride_table,  # [chunks, W] int32
    q_start_ptr,
    seq_len_ptr,  # [chunks + 1], [chunks] int32
    block_chunk_ptr,
    block_q0_ptr,  # per program row: its chunk, its first query of the chunk
    out_ptr,
    stride_ot,
    stride_oh,  # [T, Hq, DA] (SPLITS == 1)
    part_ptr,
    lse_ptr,  # SPLITS > 1: [T, Hq, SPLITS, DA] fp32, [T, Hq, SPLITS, 2] fp32
    scale_log2,
    V_PART: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HQ: tl.constexpr,
    PAGE: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLITS: tl.constexpr,
    FP8: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    block, split = tl.program_id(0), tl.program_id(2)
    kv_head, head_block = tl.program_id(1) // HEAD_BLOCKS, tl.program_id(1) % HEAD_BLOCKS
    chunk = tl.load(block_chunk_ptr + block).to(tl.int64)
    q0 = tl.load(block_q0_ptr + block)
    q_begin = tl.load(q_start_ptr + chunk)
    q_len = tl.load(q_start_ptr + chunk + 1) - q_begin
    seq_len = tl.load(seq_len_ptr + chunk)
    context = seq_len - q_len  # tokens cached before the chunk

    m = tl.arange(0, BLOCK_M)
    qi = q0 + m // BLOCK_H  # the row's query within the chunk
    in_group = head_block * BLOCK_H + m % BLOCK_H  # its head among the KV head's GROUP
    row_ok = (m < BLOCK_Q * BLOCK_H) & (qi < q_len) & (in_group < GROUP)
    head = kv_head * GROUP + in_group
    rows = (q_begin + qi).to(tl.int64)
    q_rows = q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh
    da = tl.arange(0, BLOCK_DA)[None, :]
    db = tl.arange(0, BLOCK_DB)[None, :]
    qa = tl.load(q_rows + da, mask=row_ok[:, None] & (da < DA), other=0.0).to(tl.float32)
    qb = tl.load(q_rows + DA + db, mask=row_ok[:, None] & (db < DB), other=0.0).to(tl.float32)
    if DOT_BF16:
        qa, qb = qa.to(tl.bfloat16), qb.to(tl.bfloat16)
    # the last key any row of the block sees, +1
    limit = tl.minimum(seq_len, context + q0 + BLOCK_Q)
    pages = tl.cdiv(limit, PAGE)
    per_split = tl.cdiv(pages, SPLITS)
    first, last = split * per_split, tl.minimum(pages, (split + 1) * per_split)

    best = tl.full([BLOCK_M], NEG, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DA], tl.float32)
    slot = tl.arange(0, PAGE)
    causal = (context + qi)[:, None]
    for p in range(first, last):
        page = tl.load(tables_ptr + chunk * stride_table + p).to(tl.int64)
        base = kv_ptr + page * s_page + kv_head * s_head + slot[:, None] * s_slot
        key = p * PAGE + slot
        key_ok = (key < limit)[:, None]
        ka = tl.load(base + da, mask=key_ok & (da < DA), other=0.0)
        vals = tl.load(base + V_PART * s_part + da, mask=key_ok & (da < DA), other=0.0)
        if DB > 0:
            kb = tl.load(base + DA + db, mask=key_ok & (db < DB), other=0.0)
        if DOT_BF16:
            scores = tl.dot(qa, tl.trans(ka.to(tl.bfloat16)))
            if DB > 0:
                scores += tl.dot(qb, tl.trans(kb.to(tl.bfloat16)))
        else:
            scores = tl.dot(qa, tl.trans(ka.to(tl.float32)), input_precision="ieee")
            if DB > 0:
                scores += tl.dot(qb, tl.trans(kb.to(tl.float32)), input_precision="ieee")
        if FP8:
            e_base = e_ptr + page * e_page + kv_head * e_head + slot * e_slot
            scores = scores * tl.exp2(tl.load(e_base).to(tl.float32))[None, :]
        seen = (key < limit)[None, :] & (key[None, :] <= causal)
        scores = tl.where(seen, scores * scale_log2, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_best[:, None])
        alpha = tl.exp2(best - new_best)
        total = total * alpha + tl.sum(probs, axis=1)
        if FP8:
            probs = probs * tl.exp2(tl.load(e_base + V_PART * e_part).to(tl.float32))[None, :]
        if DOT_BF16:
            acc = acc * alpha[:, None] + tl.dot(probs.to(tl.bfloat16), vals.to(tl.bfloat16))
        else:
            acc = acc * alpha[:, None] + tl.dot(probs, vals.to(tl.float32), input_precision="ieee")
        best = new_best

    keep = row_ok[:, None] & (da < DA)
    if SPLITS == 1:
        out = acc / total[:, None]
        o_rows = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(o_rows + da, stored_as(out, out_ptr.dtype.element_ty), mask=keep)
    else:
        at = (rows * HQ + head) * SPLITS + split
        tl.store(part_ptr + at[:, None] * DA + da, acc, mask=keep)
        tl.store(lse_ptr + at * 2, best, mask=row_ok)
        tl.store(lse_ptr + at * 2 + 1, total, mask=row_ok)


@triton.jit
def _merge_splits(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    DA: tl.constexpr,
    BLOCK_DA: tl.constexpr,
):
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    at = (row * HEADS + head) * SPLITS + tl.arange(0, SPLITS)
    best = tl.load(lse_ptr + at * 2)
    total = tl.load(lse_ptr + at * 2 + 1)
    weight = tl.exp2(best - tl.max(best, axis=0))
    da = tl.arange(0, BLOCK_DA)
    parts = tl.load(part_ptr + at[:, None] * DA + da[None, :], mask=da[None, :] < DA, other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    o_row = out_ptr + row * stride_ot + head * stride_oh
    tl.store(o_row + da, stored_as(out, out_ptr.dtype.element_ty), mask=da < DA)


def paged_attention(
    q: torch.Tensor,
    data: torch.Tensor,
    exps: torch.Tensor | None,
    plan: AttentionPlan,
    v_part: int,
    dims: tuple[int, int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """out[rows of plan] = attention of q [T, Hq, DA + DB] over the pages of a layer `data`
    [pages, heads, slots, parts, dim] (FP8: int8 e4m3 bits, with `exps`); dims = (DA, DB)."""
    plan = plan.to(data.device)
    q, out = q[plan.begin : plan.end], out[plan.begin : plan.end]
    da, db = dims
    heads, group = data.shape[1], q.shape[1] // data.shape[1]
    if data.dtype == torch.int8:
        data = data.view(torch.float8_e4m3fn)
    e = exps if exps is not None else data  # never read without FP8
    e_strides = exps.stride()[:4] if exps is not None else (0, 0, 0, 0)
    block_h = _heads_per_program(group, plan.block_q, da)
    block_m = max(16, triton.next_power_of_2(plan.block_q * block_h))
    head_blocks = triton.cdiv(group, block_h)
    splits = plan.splits
    parts = lse = out
    if splits > 1:
        parts = torch.empty(
            q.shape[0], q.shape[1], splits, da, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(q.shape[0], q.shape[1], splits, 2, dtype=torch.float32, device=q.device)
    _paged_attention[(len(plan.block_chunk), heads * head_blocks, splits)](
        q,
        q.stride(0),
        q.stride(1),
        data,
        *data.stride()[:4],
        e,
        *e_strides,
        plan.tables,
        plan.tables.stride(0),
        plan.q_start,
        plan.seq_lens,
        plan.block_chunk,
        plan.block_q0,
        out,
        out.stride(0),
        out.stride(1),
        parts,
        lse,
        scale * LOG2E,
        V_PART=v_part,
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_BLOCKS=head_blocks,
        HQ=q.shape[1],
        PAGE=data.shape[2],
        DA=da,
        DB=db,
        BLOCK_DA=triton.next_power_of_2(da),
        BLOCK_DB=triton.next_power_of_2(db) if db else 1,
        BLOCK_Q=plan.block_q,
        BLOCK_M=block_m,
        SPLITS=splits,
        FP8=exps is not None,
        DOT_BF16=q.dtype == torch.bfloat16 and not INTERPRETED,
    )
    if splits > 1:
        _merge_splits[(q.shape[0], q.shape[1])](
            parts,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            HEADS=q.shape[1],
            SPLITS=splits,
            DA=da,
            BLOCK_DA=triton.next_power_of_2(da),
        )


def _heads_per_program(group: int, block_q: int, dim: int) -> int:
    """Query heads of one KV head a program takes: all of them while its accumulator
    (queries x heads x dim fp32) stays within ACC_ELEMENTS, else the largest power of two that
    fits (MLA's 128 heads of 512: 16 for decode rows, 1 for prefill chunks of 16 queries)."""
    fit = max(1, ACC_ELEMENTS // (block_q * triton.next_power_of_2(dim)))
    if group <= fit:
        return group
    return 1 << (fit.bit_length() - 1)
