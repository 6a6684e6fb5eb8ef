"""The worker's KV page pool: one contiguous tensor, viewed per layer as flat slots.

Layout (fixed here; transfer code relies on it): [page, layer, k|v, slot_in_page, head, dim], so one
physical page — K and V of `page_size` tokens for every layer — is one contiguous byte range that
the transfer engine can move in a single segment. Token position p of a sequence lives in page
block_table[p // page_size] at offset p % page_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, page_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, page_size, dtype)

    @property
    def page_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    def pages_for_budget(self, budget_bytes: int) -> int:
        return max(budget_bytes // self.page_bytes, 1)


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_pages: int) -> None:
        self.spec = spec
        self.num_pages = num_pages
        self.pool = torch.zeros(
            num_pages,
            spec.num_layers,
            2,
            spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=spec.dtype,
        )
        # Per-layer [num_pages, page_size, heads, dim] strided views for the attention backend.
        self.layers = [(self.pool[:, i, 0], self.pool[:, i, 1]) for i in range(spec.num_layers)]

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.spec.page_size

    def page_address(self, page_id: int) -> int:
        """Byte address of one page (for registering with / writing through a transfer engine)."""
        return self.pool.data_ptr() + page_id * self.spec.page_bytes

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
