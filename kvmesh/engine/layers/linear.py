"""Linear methods behind one registry: how a model's matrices are stored and multiplied.

A method turns the weight(s) of one logical layer (output rows of several checkpoint tensors
fused, e.g. q/k/v) into a callable `Linear`. `dense` keeps them in the compute dtype, `int4`
stores group-wise INT4 (quant/int4.py) taking INT4 sources as they are (GGUF Q4 blocks,
compressed-tensors pack-quantized) and quantizing float ones. Models ask `method_for(scheme,
role)` which method a layer gets; they never test weight types themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from kvmesh.config import Int4Scheme
from kvmesh.engine.kernels import cpu_ops, has_amx, kernel_isa
from kvmesh.engine.platform import for_device, kernels_for
from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight
from kvmesh.errors import ModelFormatError

Source = torch.Tensor | Int4Weight  # a checkpoint matrix as loaded


class Linear(Protocol):
    """y = x @ W^T (+ bias)."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class LinearMethod(Protocol):
    name: str

    def create(self, parts: Sequence[Source], bias: torch.Tensor | None) -> Linear:
        """One layer from the output rows of `parts`, in order."""
        ...


GEMV_ROWS = 4  # bf16 rows up to which products go through the GEMV kernel where AMX follows
AMX_ROWS = 64  # ... then AMX tiles up to this many rows
# without AMX: the GEMV (in register tiles above 8 rows) up to this many rows, by the kernels' ISA
TILED_ROWS = {"avx512": 32, "avx2": 1 << 62}


# fp32: the GEMV kernel (kernels/csrc/gemv_f32.cpp) up to this many rows, by the kernels' ISA
F32_GEMV_ROWS = {"avx512": 8, "avx2": 4}
# fp32 above those: torch's GEMM with the weight as left operand, (weight @ x^T)^T, for this many rows and
# weights at least this large (see dense_kernel)
WEIGHT_LEFT_ROWS = (2, 64)
WEIGHT_LEFT_MIN = 1 << 22

# dense_kernel's answers (kernels/csrc/decoder.cpp reads them too; 3 and 4 are fused_decode's)
GEMV, AMX, TORCH, WEIGHT_LEFT = 0, 1, 2, 5


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ weight^T (+ bias), through the kernel `dense_kernel` picks for rows on CPU."""
    ops = kernels_for(x) if x.dim() == 2 and x.dtype is weight.dtype else None
    if ops is not None:
        kernel = dense_kernel(x.shape[0], weight)
        if kernel == GEMV:
            gemv = ops.linear_f32 if weight.dtype is torch.float32 else ops.linear_bf16
            return gemv(x, weight, bias)
        if kernel == AMX:
            return ops.linear_bf16_amx(x, weight, bias)
        if kernel == WEIGHT_LEFT:
            out = torch.mm(weight, x.t()).t().contiguous()
            return out if bias is None else out + bias  # the order decoder.cpp runs too
    return F.linear(x, weight, bias)


def dense_kernel(rows: int, weight: torch.Tensor) -> int:
    """Which kernel multiplies `rows` rows by a CPU `weight` of their dtype.

    fp32: up to F32_GEMV_ROWS rows the GEMV kernel, which reads the weight once at memory speed
    (torch's x @ W^T reads it well below that at a few rows); above, torch's GEMM, but up to 64
    rows and for a weight of >= 4 Mi elements as weight @ x^T. MKL's x @ W^T at a few rows
    re-reads the weight, at some row counts far more than at the next larger ones, while
    weight @ x^T was never slower from 2 to 64 rows on the large weights measured
    (docs/benchmarks-history.md, "fp32 linears as weight @ x^T, and speculation baselines
    measured per batch", and for the GEMV "Delivery on a plain socket, an fp32 GEMV, and each
    single-stream request against its own ceiling"). One row stays x @ W^T (a GEMV either way).

    bf16: small batches go through
    a kernel that reads the weight once at memory speed, each row's sum in a fixed order
    whatever the batch: where the CPU has AMX, the GEMV (kernels/csrc/gemv.cpp) up to GEMV_ROWS
    and AMX tiles (amx_linear.cpp) up to AMX_ROWS; on other AVX-512 CPUs the GEMV, in register
    tiles above 8 rows, up to TILED_ROWS (above, torch's GEMM is as fast); on AVX2 CPUs, which
    have no bf16 arithmetic, the GEMV at every batch (torch's bf16 GEMM is several times slower
    there). Otherwise torch's GEMM (docs/benchmarks.md, "CPU kernels vs torch")."""
    if weight.dtype is torch.float32:
        if cpu_ops() is not None and rows <= F32_GEMV_ROWS.get(kernel_isa() or "", 0):
            return GEMV
        low, high = WEIGHT_LEFT_ROWS
        return WEIGHT_LEFT if low <= rows <= high and weight.numel() >= WEIGHT_LEFT_MIN else TORCH
    if weight.dtype is not torch.bfloat16 or cpu_ops() is None:
        return TORCH
    if has_amx() and weight.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0:
        if rows <= GEMV_ROWS:
            return GEMV
        if rows <= AMX_ROWS:
            return AMX
    elif rows <= TILED_ROWS[kernel_isa()]:
        return GEMV
    return TORCH


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)


class BiasedInt4Linear:
    def __init__(self, inner: Int4Linear, bias: torch.Tensor) -> None:
        self.inner, self.bias = inner, bias
        self.out_features = inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.bias

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.bias.nbytes


class Dense:
    name = "dense"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def create(self, parts: Sequence[Source], bias: torch.Tensor | None) -> Linear:
        weights = [dense(p, self.dtype) for p in parts]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return DenseLinear(weight, bias)


class Int4:
    """Group-wise INT4; `group` 0 keeps an INT4 source's own groups (float sources: 32)."""

    name = "int4"

    def __init__(self, dtype: torch.dtype, group: int = 0) -> None:
        self.dtype, self.group = dtype, group

    def quantized(self, part: Source) -> Int4Weight:
        if isinstance(part, Int4Weight):
            return part.regroup(self.group) if self.group else part
        return Int4Weight.quantize(part.float(), self.group or 32)

    def create(self, parts: Sequence[Source], bias: torch.Tensor | None) -> Linear:
        try:
            weight = Int4Weight.cat([self.quantized(p) for p in parts])
        except ValueError as exc:
            raise ModelFormatError(f"cannot store this layer in INT4: {exc}") from None
        layer = for_device(weight.q.device).int4_linear(weight, self.dtype)
        return layer if bias is None else BiasedInt4Linear(layer, bias)


class Native:
    """A checkpoint's own INT4 (compressed-tensors experts) stays INT4, the rest stays dense:
    `--weights int4` on a model that ships INT4 (Kimi K2: attention, shared experts, dense
    layers and the LM head in bf16, routed experts INT4)."""

    name = "native-int4"

    def __init__(self, dtype: torch.dtype) -> None:
        self.int4, self.dense = Int4(dtype), Dense(dtype)

    def create(self, parts: Sequence[Source], bias: torch.Tensor | None) -> Linear:
        native = all(isinstance(p, Int4Weight) for p in parts)
        return (self.int4 if native else self.dense).create(parts, bias)


METHODS = {"dense": Dense, "int4": Int4, "native-int4": Native}


def method_for(int4: Int4Scheme | None, dtype: torch.dtype, native: bool = False) -> LinearMethod:
    """The method of a model's decoder linears under `int4` (None: dense); `native`: the
    checkpoint ships its own INT4 linears."""
    if int4 is None:
        return Dense(dtype)
    return Native(dtype) if native else Int4(dtype, int4.group)


def dense(part: Source, dtype: torch.dtype) -> torch.Tensor:
    """A matrix in the compute dtype (an INT4 source dequantized)."""
    if isinstance(part, Int4Weight):
        part = part.dequantize()
    return part.to(dtype).contiguous()
