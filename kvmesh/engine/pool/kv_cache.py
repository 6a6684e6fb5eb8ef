"""The worker's KV page pool: one contiguous byte tensor, viewed per layer by the spec's kind.

Layout (fixed in kv/layout.py; transfer code relies on it): page p is bytes
[p * page_bytes, (p + 1) * page_bytes), head-major, and holds `page_size` tokens of every layer
(plus FP8 scales). Token position i of a sequence lives in page block_table[i // page_size] at
offset i % page_size.

A layer is `GqaLayerKV` (K and V side by side per slot) or `MlaLayerKV` (one latent vector per
slot), both over one `PagedLayer`; attention backends for each kind use them.

The pool has one page more than the block manager hands out, `null_page`: zeros that nothing
writes. Attention metadata points every padding slot of a batch at it, so a row never reads
bytes it does not own (another request's, a reassigned page's, stale slots of its own last page:
0 * NaN would poison it) and no backend has to mask what it gathered.

Beside the pool, `tags` holds one 32-bit integrity tag per page: the tag of the allocation whose
KV the page holds (see kv/block_manager.py). It is separate memory, registered with the transfer
engine on its own, so a prefill worker writes it after the page bytes.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from kvmesh.engine.attention.base import Slots
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.platform import for_device, kernels_for

__all__ = ["GqaLayerKV", "KVCacheSpec", "MlaLayerKV", "PagedKVCache"]
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.int8}
_KEYS = itertools.count()


class PagedLayer:
    """One layer's slice of the pool: `data` [pages, heads, page_size, parts, dim] in the storage
    dtype (parts: K|V for GQA, 1 for MLA), with FP8 exponents `exps` [pages, heads, page_size,
    parts] when quantized. Reads and writes take (page, offset) slots and return / accept
    [*S, heads, parts, dim] in the compute dtype: one gather per layer and step, K and V of a
    slot side by side."""

    def __init__(self, data: torch.Tensor, exps: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.data, self.exps, self.dtype = data, exps, dtype
        self._same = data.dtype == dtype
        self.key = torch.tensor(next(_KEYS))  # a tensor: one compiled graph serves every layer
        _register(self)
        if exps is not None:
            self.quantize, self.dequantize = for_device(data.device).kv_codec()

    def write(self, slots: Slots, x: torch.Tensor) -> None:
        index = (slots.page, slice(None), slots.offset)
        if self.exps is None:
            self.data[index] = x.to(self.data.dtype)
        else:
            self.data[index], self.exps[index] = self.quantize(x)

    def read(self, slots: Slots) -> torch.Tensor:
        index = (slots.page, slice(None), slots.offset)
        if self.exps is not None:
            return self.dequantize(self.data[index], self.exps[index], self.dtype)
        x = self.data[index]
        return x if self._same else x.to(self.dtype)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """What `read` would return for x after a `write`: attention always sees the cache's
        values, so a prompt computed cold and one whose prefix came from the cache agree."""
        if self.exps is not None:
            return self.dequantize(*self.quantize(x), self.dtype)
        return x if self._same else x.to(self.data.dtype).to(self.dtype)


def _register(layer: PagedLayer) -> None:
    """Make the pages reachable by the kernels' write-and-attend op under `layer.key`, for as
    long as the layer lives (kernels/csrc/kv_write.cpp)."""
    ops = kernels_for(layer.data)
    if ops is not None:
        key = int(layer.key)
        ops.register_layer(key, layer.data, layer.exps)
        weakref.finalize(layer, ops.forget_layer, key)


class GqaLayerKV:
    """One GQA/MHA layer: K and V of each KV head."""

    kind = "gqa"

    def __init__(self, layer: PagedLayer) -> None:
        self.layer = layer

    def write(self, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hkv, D] of new tokens at `slots`."""
        self.layer.write(slots, torch.stack((k, v), dim=-2))

    def read(self, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S) as [*S, Hkv, D] in the compute dtype."""
        kv = self.layer.read(slots)
        return kv[..., 0, :], kv[..., 1, :]

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.layer.as_stored(torch.stack((k, v), dim=-2))
        return kv[..., 0, :], kv[..., 1, :]


class MlaLayerKV:
    """One MLA layer: per token the normalized latent then the rotated shared key, one vector."""

    kind = "mla"

    def __init__(self, layer: PagedLayer) -> None:
        self.layer = layer

    def write(self, slots: Slots, entry: torch.Tensor) -> None:
        """Store latent|rope entries [T, D] of new tokens at `slots`."""
        self.layer.write(slots, entry[:, None, None, :])

    def read(self, slots: Slots) -> torch.Tensor:
        """Entries at `slots` (any shape S) as [*S, D] in the compute dtype."""
        return self.layer.read(slots)[..., 0, 0, :]

    def as_stored(self, entry: torch.Tensor) -> torch.Tensor:
        return self.layer.as_stored(entry[:, None, None, :])[:, 0, 0, :]


class PagedKVCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_pages: int,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pool: torch.Tensor | None = None,
    ) -> None:
        """pool: zeroed memory [num_pages + 2, page_bytes] uint8 to use (a tensor-parallel
        rank's part of shared memory: parallel/ranks.py), else a new one."""
        self.spec = spec
        self.num_pages = num_pages
        self.null_page = num_pages  # one more page, never allocated nor written: all zeros
        self.scratch_page = (
            num_pages + 1
        )  # never allocated: padding rows of compiled steps write here
        rows = num_pages + 2
        if pool is None:
            pool = torch.zeros(rows, spec.page_bytes, dtype=torch.uint8, device=device)
        elif pool.shape != (rows, spec.page_bytes) or pool.dtype != torch.uint8:
            raise ValueError(
                f"a pool of {num_pages} pages needs [{rows}, {spec.page_bytes}] "
                f"uint8, got {list(pool.shape)} {pool.dtype}"
            )
        self.pool = pool
        self.tags = torch.zeros(rows, dtype=torch.int32)  # host memory on every platform
        blocks = self.pool.view(rows, spec.num_heads, spec.head_block_bytes)
        self.layers = [self._layer(blocks, i, compute_dtype) for i in range(spec.num_layers)]

    def _layer(self, blocks: torch.Tensor, i: int, dtype: torch.dtype):
        spec, layer = self.spec, self.spec.layers[i]
        shape = (*blocks.shape[:2], spec.page_size, layer.parts)
        start = spec.data_offset(i)
        data = blocks[..., start : start + spec.data_bytes_of(i)].view(_TORCH[spec.kv_dtype])
        data = data.view(*shape, layer.head_dim)
        exps = None
        if spec.quantized:
            start = spec.scale_offset(i)
            exps = blocks[..., start : start + spec.scale_bytes_of(i)].view(torch.int8)
            exps = exps.view(*shape)
        paged = PagedLayer(data, exps, dtype)
        return GqaLayerKV(paged) if layer.kind == "gqa" else MlaLayerKV(paged)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.spec.page_size

    def page_address(self, page_id: int) -> int:
        """Byte address of one page (for registering with / writing through a transfer engine)."""
        return self.pool.data_ptr() + page_id * self.spec.page_bytes

    def tag_address(self, page_id: int) -> int:
        """Byte address of one page's 4-byte integrity tag."""
        return self.tags.data_ptr() + page_id * 4

    @property
    def nbytes(self) -> int:
        return self.pool.numel()
