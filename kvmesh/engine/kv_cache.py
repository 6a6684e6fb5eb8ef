"""The worker's KV page pool: one contiguous byte tensor, viewed per layer by a codec object.

Layout (fixed in kv/layout.py; transfer code relies on it): page p is bytes
[p * page_bytes, (p + 1) * page_bytes) and holds K and V of `page_size` tokens for every layer
(plus FP8 scales). Token position i of a sequence lives in page block_table[i // page_size] at
offset i % page_size.

Beside the pool, `tags` holds one 32-bit integrity tag per page: the tag of the allocation whose
KV the page holds (see kv/block_manager.py). It is separate memory, registered with the transfer
engine on its own, so a prefill worker writes it after the page bytes.
"""

from __future__ import annotations

import torch

from kvmesh.engine.attention.base import Slots
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.kv_fp8 import codec_for

__all__ = ["KVCacheSpec", "PagedKVCache", "spec_for_model"]
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.int8}


def spec_for_model(config: ModelConfig, page_size: int, kv_dtype: str) -> KVCacheSpec:
    return KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, page_size, kv_dtype)


class PlainLayerKV:
    """One layer's K and V stored as is (fp32 or bf16): [num_pages, page_size, heads, dim] views.
    The storage dtype may differ from the compute dtype (e.g. bf16 KV under an fp32 model)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
        self.k, self.v, self.dtype = k, v, dtype
        self._same = k.dtype == dtype

    def write(self, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[slots.page, slots.offset] = k.to(self.k.dtype)
        self.v[slots.page, slots.offset] = v.to(self.v.dtype)

    def read(self, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[slots.page, slots.offset], self.v[slots.page, slots.offset]
        return (k, v) if self._same else (k.to(self.dtype), v.to(self.dtype))

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._same:
            return k, v
        return k.to(self.k.dtype).to(self.dtype), v.to(self.v.dtype).to(self.dtype)


class Fp8LayerKV:
    """One layer's K and V as e4m3 bits plus a power-of-two exponent per (token, head)."""

    def __init__(self, k, v, k_exp, v_exp, dtype: torch.dtype) -> None:
        self.k, self.v, self.k_exp, self.v_exp, self.dtype = k, v, k_exp, v_exp, dtype
        self.quantize, self.dequantize = codec_for(k.device)

    def write(self, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        index = (slots.page, slots.offset)
        self.k[index], self.k_exp[index] = self.quantize(k)
        self.v[index], self.v_exp[index] = self.quantize(v)

    def read(self, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        index = (slots.page, slots.offset)
        return (
            self.dequantize(self.k[index], self.k_exp[index], self.dtype),
            self.dequantize(self.v[index], self.v_exp[index], self.dtype),
        )

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `read` would return for k, v: attention always sees the cache's values, so a
        prompt computed cold and one whose prefix came from the cache give the same tokens."""
        return (
            self.dequantize(*self.quantize(k), self.dtype),
            self.dequantize(*self.quantize(v), self.dtype),
        )


class PagedKVCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_pages: int,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.spec = spec
        self.num_pages = num_pages
        self.pool = torch.zeros(num_pages, spec.page_bytes, dtype=torch.uint8, device=device)
        self.tags = torch.zeros(num_pages, dtype=torch.int32, device=device)
        shape = (num_pages, spec.num_layers, 2, spec.page_size, spec.num_kv_heads)
        data = self.pool[:, : spec.data_bytes].view(_TORCH[spec.kv_dtype])
        data = data.view(*shape, spec.head_dim)
        if spec.quantized:
            exps = self.pool[:, spec.data_bytes :].view(torch.int8).view(*shape)
            self.layers = [
                Fp8LayerKV(
                    data[:, i, 0], data[:, i, 1], exps[:, i, 0], exps[:, i, 1], compute_dtype
                )  # fmt: skip
                for i in range(spec.num_layers)
            ]
        else:
            self.layers = [
                PlainLayerKV(data[:, i, 0], data[:, i, 1], compute_dtype)
                for i in range(spec.num_layers)
            ]

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
