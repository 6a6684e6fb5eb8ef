"""The decoder's linear weights in one allocation, in the order a decode step reads them.

A decode step of a few rows streams every weight from memory once. As the loader builds them,
each fused weight is an allocation of its own, most on the heap's 4 KiB pages; `pack` copies
them once into one allocation of their total size, asked for transparent huge pages
(`madvise(MADV_HUGEPAGE)`, Linux), in the order the step reads them (per layer q|k|v, o,
gate|up, down; INT4 packed bytes, then their scales). The TLB then covers the stream, and the
kernels' prefetches run on from one linear into the next. The old copies are freed and the heap
trimmed, so no second copy stays resident. Decode steps and a chain of SmolLM2's layer GEMVs
ran faster this way (docs/benchmarks-history.md, "One parallel region per step, weights in
stream order, phases no thread holds up, and random draws by inverse CDF").
"""

from __future__ import annotations

import ctypes
import functools
import os

import structlog
import torch

from kvmesh.engine.layers.linear import BiasedInt4Linear, DenseLinear
from kvmesh.engine.platform import kernels_for
from kvmesh.engine.quant.int4 import Int4Linear

log = structlog.get_logger(__name__)
HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line
MADV_HUGEPAGE = 14
TRIM_EVERY = 64 << 20


def _slots(linear) -> list[tuple[object, str]]:
    """(owner, attribute) of each weight tensor of `linear`, in the order its kernel reads them."""
    if isinstance(linear, DenseLinear):
        return [(linear, "weight")]
    inner = linear.inner if isinstance(linear, BiasedInt4Linear) else linear
    if isinstance(inner, Int4Linear):
        return [(inner, "packed"), (inner, "scales_zeros")]
    return []


def pack(linears: list) -> torch.Tensor | None:
    """Moves the CPU weights of `linears` (in stream order) into one allocation, each attribute
    then a view of it; returns the allocation (None: nothing to pack)."""
    slots = [(o, a) for linear in linears for o, a in _slots(linear)]
    kept = [getattr(o, a) for o, a in slots]
    if not kept or any(kernels_for(t) is None or not t.is_contiguous() for t in kept):
        return None
    shapes = [(t.dtype, t.shape, t.nbytes) for t in kept]
    del kept  # each old copy goes as soon as its view holds its values (peak: one weight more)
    offsets, size = [], 0
    for _, _, nbytes in shapes:
        offsets.append(size)
        size += -(-nbytes // ALIGN) * ALIGN
    arena = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    start = -arena.data_ptr() % HUGE_PAGE
    huge = _advise_huge_pages(arena.data_ptr() + start, size)
    arena = arena[start : start + size]
    freed = 0
    for (owner, attr), (dtype, shape, nbytes), at in zip(slots, shapes, offsets, strict=True):
        view = arena[at : at + nbytes].view(dtype).view(shape)
        view.copy_(getattr(owner, attr))
        setattr(owner, attr, view)
        freed += nbytes
        if freed >= TRIM_EVERY:  # hand the freed copies' pages back as it goes
            _trim_heap()
            freed = 0
    _trim_heap()
    log.info("weights.packed", mib=round(size / 2**20, 1), tensors=len(slots), huge_pages=huge)
    return arena


@functools.cache
def _libc():
    """This process's C library (its madvise and malloc_trim), or None."""
    try:
        return ctypes.CDLL(None)  # dlopen(NULL): the symbols already loaded, libc's among them
    except OSError:
        return None


def _advise_huge_pages(address: int, size: int) -> bool:
    """Whether Linux took the advice (THP "madvise" or "always"; "never" refuses nothing).
    THP_MEM_ALLOC_ENABLE=0 (kvmesh/__init__.py: torch's allocator's switch) keeps 4 KiB pages."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "0":
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return False
    length = size // HUGE_PAGE * HUGE_PAGE
    return (
        length > 0
        and libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    )


def _trim_heap() -> None:
    """Hands the freed copies' pages back (glibc keeps freed heap memory otherwise)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
