"""The worker's KV page pool: one contiguous tensor, viewed per layer as flat slots.

Layout (fixed here, relied upon by transfer code later): [layer, k|v, page, slot_in_page, head, dim].
Slot index of token position p of a sequence = block_table[p // page_size] * page_size + p % page_size.
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
            spec.num_layers,
            2,
            num_pages * spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=spec.dtype,
        )
        self.layers = [(self.pool[i, 0], self.pool[i, 1]) for i in range(spec.num_layers)]

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.spec.page_size

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
