"""INT4 weight-only, group-wise, asymmetric: w ~= (q - 8) * scale + zero, q in 0..15, one
(scale, zero) per `group` consecutive input features of each output row -- torch's tinygemm
convention, so the CPU kernel `_weight_int4pack_mm_for_cpu` consumes it as is.

Sources: round-to-nearest from float weights (min/max per group), or GGUF Q4_1 / Q4_0 blocks
taken over exactly: a Q4_1 block of 32 is w = d * q + m, i.e. scale = d, zero = m + 8 d (Q4_0:
w = d * (q - 8), zero = 0) -- no dequantize-requantize round trip. `regroup` is the explicit,
lossy exception (e.g. Q4_1's groups of 32 into groups of 64, for memory).

Kernels behind one `Int4Linear`: CPU `_weight_int4pack_mm_for_cpu` (activations fp32/bf16; up to
SMALL_BATCH rows the GEMV of kernels/csrc/int4_gemv.cpp over the same packed bytes), CUDA
`_weight_int4pack_mm` (tensor-core tinygemm, bf16 activations). On CPU, `Int4Linear.rows` reads
rows straight out of the packed weight, so a tied embedding / LM head is stored once, in INT4.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# rows up to which the CPU GEMV kernel runs (above 4, a row block 4 batch rows at a time, its
# bytes from cache after the first 4: faster than torch's int4 kernel up to here;
# docs/benchmarks-history.md, "Delivery on a plain socket, an fp32 GEMV, and each single-stream
# request against its own ceiling")
SMALL_BATCH = 16
# From this many fp32 rows on (and above SMALL_BATCH where that kernel runs), the weight is
# dequantized to fp32 and multiplied densely: torch's CPU int4 kernel runs fp32 activations some
# 60x slower than bf16, ~0.8 ms a row of a 576 x 1536 weight (torch 2.13) against ~6 ms for the
# dequantization and matmul, whatever the rows (same values to fp32 rounding).
DENSE_FP32_ROWS = 8


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // group] float32
    zero: torch.Tensor  # [N, K // group] float32
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the weight the kernel multiplies by."""
        n, k = self.shape
        q = self.q.float().view(n, k // self.group, self.group)
        return ((q - 8) * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k)

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int = 32, search: bool = True) -> Int4Weight:
        """Round-to-nearest, asymmetric per group. search: per group, the clipping of the
        min/max range (a grid of 6 x 6 shrinks, up to 15 % off each end) and a least-squares
        refit of (scale, offset) that give the smallest squared error -- never worse than plain
        min/max, which is one of the candidates."""
        n, k = w.shape
        if k % group:
            raise ValueError(f"input features {k} are not a multiple of the group size {group}")
        shrinks = torch.linspace(0, 0.15, 6) if search else None
        parts = [
            _fit(chunk.float().view(-1, k // group, group), shrinks) for chunk in w.split(4096)
        ]
        q, scale, offset = (torch.cat(t) for t in zip(*parts, strict=True))
        return cls(q.to(torch.uint8).view(n, k), scale, offset + 8 * scale, group)

    @classmethod
    def from_gguf_blocks(cls, raw: np.ndarray, qtype: str, rows: int, cols: int) -> Int4Weight:
        """GGUF Q4_1 (d, m, 16 bytes of nibbles) or Q4_0 (d, nibbles) blocks of 32, row-major."""
        block = {"Q4_1": 20, "Q4_0": 18}[qtype]
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, block)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if qtype == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            nibbles = blocks[..., 4:]
        else:
            m = -8.0 * d
            nibbles = blocks[..., 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # value j, then j + 16
        scale = torch.from_numpy(d)
        return cls(
            torch.from_numpy(q.reshape(rows, cols).astype(np.uint8)),
            scale,
            torch.from_numpy(m) + 8 * scale,
            32,
        )

    def regroup(self, group: int) -> Int4Weight:
        """Requantized to another group size (`quantize` of the dequantized weight: lossy,
        unlike taking GGUF blocks over)."""
        return self if group == self.group else Int4Weight.quantize(self.dequantize(), group)

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        """Output rows (dim 0) or input features (dim 1, whole groups only) [start, +length):
        a tensor-parallel shard, the same quantized values."""
        if dim == 0:
            return Int4Weight(
                *(t.narrow(0, start, length).contiguous() for t in (self.q, self.scale, self.zero)),
                self.group,
            )
        if start % self.group or length % self.group:
            raise ValueError(f"input features [{start}, +{length}) split a group of {self.group}")
        g0, groups = start // self.group, length // self.group
        return Int4Weight(
            self.q.narrow(1, start, length).contiguous(),
            self.scale.narrow(1, g0, groups).contiguous(),
            self.zero.narrow(1, g0, groups).contiguous(),
            self.group,
        )

    def rows(self, order: torch.Tensor) -> Int4Weight:
        """The same weight with its output rows reordered (e.g. llama.cpp's Q/K permutation)."""
        return Int4Weight(self.q[order], self.scale[order], self.zero[order], self.group)

    @staticmethod
    def cat(parts: Sequence[Int4Weight]) -> Int4Weight:
        """Stack output rows (fused QKV / gate-up); the groups run along inputs, unaffected."""
        groups = {p.group for p in parts}
        if len(groups) != 1:
            raise ValueError(f"cannot fuse INT4 weights of group sizes {sorted(groups)}")
        return Int4Weight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            groups.pop(),
        )


def scales_zeros_of(weight: Int4Weight, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[K/g, N, 2] (scale, zero) per group and row: torch's INT4 kernels' operand."""
    scales_zeros = torch.stack([weight.scale, weight.zero], dim=-1)  # [N, K/g, 2]
    return scales_zeros.transpose(0, 1).contiguous().to(device, dtype)


class Int4Linear:
    """y = x W^T with W in INT4 on the CPU, activations fp32 or bf16 (the CUDA platform's is
    int4_cuda.py)."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        self.out_features, self.in_features = weight.shape
        self.group = weight.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.q.to(torch.int32), 1
        )
        self.scales_zeros = scales_zeros_of(weight, dtype, weight.q.device)
        # Rows per block of the packed layout `rows` reads (0: it cannot read this one).
        self.block = _cpu_row_block(self.out_features)
        self._small_batch = self._small_batch_ops()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.runs_small_batch(flat.shape[0]):
            out = self._small_batch.int4_linear(
                flat, self.packed, self.group, self.scales_zeros, self.block
            )
        elif flat.dtype == torch.float32 and self.can_read_rows and len(flat) >= DENSE_FP32_ROWS:
            out = flat @ self.dense().T
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group, self.scales_zeros
            )
        return out.view(*x.shape[:-1], self.out_features)

    def _small_batch_ops(self):
        """The CPU kernel for a few rows (kernels/csrc/int4_gemv.cpp), which reads this same
        packed weight in its 32- or 64-row blocks; None: torch's kernel for every batch. Set
        once at construction: a compiled graph reads it as a plain attribute."""
        if self.block not in (32, 64) or self.group % 16:
            return None
        from kvmesh.engine.kernels import cpu_ops

        return cpu_ops()

    @property
    def can_read_rows(self) -> bool:
        return self.block > 0

    def runs_small_batch(self, rows: int) -> bool:
        """Whether `rows` CPU rows go through kernels/csrc/int4_gemv.cpp (else torch's kernel)."""
        return rows <= SMALL_BATCH and self._small_batch is not None

    @property
    def has_small_batch_kernel(self) -> bool:
        """Whether up to SMALL_BATCH rows go through kernels/csrc/int4_gemv.cpp here."""
        return self._small_batch is not None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows W[ids] [T, K] in the activation dtype (an embedding lookup), read
        from the CPU kernel's packed layout: blocks of `b` rows stored [K, b/2] bytes, row
        j < b/2 in the low nibbles and row j + b/2 in the high ones."""
        if not self.can_read_rows:
            raise ValueError("rows() needs the CPU packed layout of a known block size")
        q = read_nibbles(self.packed, self.block, ids, self.in_features)
        return self._dequantize(q, self.scales_zeros[:, ids])

    def dense(self) -> torch.Tensor:
        """The whole weight W [N, K] dequantized to the activation dtype, each packed block
        unpacked in place (no gather)."""
        if not self.can_read_rows:
            raise ValueError("dense() needs the CPU packed layout of a known block size")
        blocks = self.packed.view(-1, self.in_features, self.block // 2)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).transpose(1, 2)
        return self._dequantize(q.reshape(-1, self.in_features), self.scales_zeros)

    def _dequantize(self, q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
        """Values q [T, K] (0..15) with their scales_zeros [K/g, T, 2] -> weights [T, K]."""
        k, g = self.in_features, self.group
        scales_zeros = scales_zeros.float()
        scale = scales_zeros[..., 0].T.unsqueeze(-1)
        zero = scales_zeros[..., 1].T.unsqueeze(-1)
        q = q.float().view(-1, k // g, g)
        return ((q - 8) * scale + zero).view(-1, k).to(self.scales_zeros.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def _fit(
    wg: torch.Tensor, shrinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best (q, scale, offset) per group of wg [R, G, g], w ~= q * scale + offset, over the
    range clippings `shrinks`, scale and offset refit by least squares for each candidate q
    (None: plain min/max)."""
    low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    spread = high - low
    if shrinks is None:
        step = (spread / 15).clamp_min(1e-10)
        return ((wg - low) / step).round_().clamp_(0, 15), step.squeeze(-1), low.squeeze(-1)
    # Per candidate only group sums are kept: with wc = w - mean(w), the least-squares fit of
    # w ~ scale * q + offset leaves sum(wc^2) - cov^2 / var (cov = sum(q wc), var = sum(q^2) -
    # g mean(q)^2); q itself is computed again once, for each group's best candidate.
    g = wg.shape[-1]
    w_mean = wg.mean(-1, keepdim=True)
    wc = wg - w_mean
    total = wc.square().sum(-1, keepdim=True)
    best_err = best_lo = best_step = None
    for a in shrinks:
        for b in shrinks:
            lo = low + a * spread
            step = ((spread * (1 - a - b)) / 15).clamp_min(1e-10)
            q = wg.sub(lo).div_(step).round_().clamp_(0, 15)
            q_sum = q.sum(-1, keepdim=True)
            var = torch.linalg.vecdot(q, q).unsqueeze(-1) - q_sum.square() / g
            cov = torch.linalg.vecdot(q, wc).unsqueeze(-1)
            err = torch.where(var > 0, total - cov.square() / var.clamp_min(1e-12), total)
            if best_err is None:
                best_err, best_lo, best_step = err, lo, step
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo = torch.where(better, lo, best_lo)
            best_step = torch.where(better, step, best_step)
    q = wg.sub(best_lo).div_(best_step).round_().clamp_(0, 15)
    q_mean = q.mean(-1, keepdim=True)
    var = (q - q_mean).square().sum(-1, keepdim=True)
    cov = torch.linalg.vecdot(q - q_mean, wc).unsqueeze(-1)
    scale = torch.where(var > 0, cov / var.clamp_min(1e-12), best_step)
    offset = w_mean - scale * q_mean
    return q, scale.squeeze(-1), offset.squeeze(-1)


def read_nibbles(packed: torch.Tensor, block: int, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Values [T, K] (0..15) of rows `ids` from the CPU layout [N / block, K, block / 2] bytes."""
    half = block // 2
    blocks = packed.view(-1, k, half)
    within = ids % block
    data = blocks[ids // block, :, within % half]  # [T, K]
    shift = (within >= half).to(torch.uint8).mul_(4).unsqueeze(-1)
    return (data >> shift) & 15


@functools.cache
def _cpu_row_block(rows: int) -> int:
    """Rows per block of `_convert_weight_to_int4pack_for_cpu`'s layout (it depends on the CPU's
    vector ISA): the block size whose reading (`read_nibbles`) gives back random values packed
    by torch; 0 if none does or `rows` is not a whole number of blocks."""
    for block in (64, 32, 16):
        if rows % block:
            continue
        n, k = 2 * block, 16
        values = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(block))
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
        except RuntimeError:
            continue
        if packed.numel() * 2 == n * k and torch.equal(
            read_nibbles(packed, block, torch.arange(n), k).long(), values
        ):
            return block
    return 0
