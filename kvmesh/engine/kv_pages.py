"""A worker's whole page pool as transfers and the KV store see it (kv/pool_layout.py): one
shard per tensor-parallel rank, rank 0's in its own engine, the others' in shared memory that
rank 0 maps too (parallel/ranks.py), or the one pool of a single-rank engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.kv.pool_layout import PageSide, PoolLayout, PoolShard
from kvmesh.engine.kv_cache import PagedKVCache


class KvPages:
    def __init__(self, spec: KVCacheSpec, pools: Sequence[torch.Tensor],
                 heads: Sequence[range], region: torch.Tensor) -> None:  # fmt: skip
        """spec: the logical page's (every head); pools[r]: rank r's [pages, heads[r] blocks];
        region: memory holding every pool (what a transfer engine registers)."""
        self.spec, self.pools, self.region = spec, list(pools), region
        shards = tuple(
            PoolShard(p.data_ptr(), h.start, len(h)) for p, h in zip(pools, heads, strict=True)
        )
        self.layout = PoolLayout(shards, spec.head_block_bytes, spec.num_heads)

    @classmethod
    def whole(cls, cache: PagedKVCache) -> KvPages:
        return cls(cache.spec, [cache.pool], [range(cache.spec.num_heads)], cache.pool)

    @property
    def sharded(self) -> bool:
        return len(self.pools) > 1

    def side(self, pages: Sequence[int]) -> PageSide:
        return self.layout.side(pages)

    def gather(self, pages: Sequence[int]) -> torch.Tensor:
        """Copies of whole pages, [len(pages), page_bytes] uint8 (each head once, in order)."""
        index = torch.tensor(list(pages), dtype=torch.long)
        if not self.sharded:
            return self.pools[0][index]
        runs = self.layout.side([0]).runs()
        return torch.cat([self.pools[s][index, at : at + n] for s, at, n in runs], dim=1)
