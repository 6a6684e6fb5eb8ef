"""A worker's whole page pool as transfers and the KV store see it (kv/pool_layout.py): one
shard per rank (its KV heads, its pipeline stage's layers), rank 0's in its own engine, the
others' in shared memory that rank 0 maps too (parallel/ranks.py), or the one pool of a
single-rank engine.

`--kv-transfer staged` (`StagedKvPages`): transfers see a host mirror of the pool instead of the
pool (a GPU's pages that the non-CUDA transfer engine cannot register). Whoever sends pages
stages them out first (pool -> mirror), whoever received pages stages them in (mirror -> pool):
one copy per run of consecutive page ids. With direct transfers both are no-ops."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.kv.pool_layout import PageSide, PoolLayout, PoolShard
from kvmesh.engine.pool.kv_cache import PagedKVCache


class KvPages:
    def __init__(
        self,
        spec: KVCacheSpec,
        pools: Sequence[torch.Tensor],
        spans: Sequence[tuple[range, ...]],
        region: torch.Tensor,
    ) -> None:
        """spec: the logical page's (every head and layer); pools[r]: rank r's [pages, bytes],
        holding the whole page's `spans[r]` end to end (pool_layout.shard_spans); region:
        memory holding every pool (what a transfer engine registers)."""
        self.spec, self.pools, self.region = spec, list(pools), region
        shards = tuple(PoolShard(p.data_ptr(), s) for p, s in zip(pools, spans, strict=True))
        self.layout = PoolLayout(shards, spec.page_bytes)

    @classmethod
    def whole(cls, cache: PagedKVCache) -> KvPages:
        return cls(cache.spec, [cache.pool], [(range(cache.spec.page_bytes),)], cache.pool)

    @property
    def sharded(self) -> bool:
        return len(self.pools) > 1

    def side(self, pages: Sequence[int]) -> PageSide:
        return self.layout.side(pages)

    staged = False  # transfers reach the pool itself

    def stage_out(self, pages: Sequence[int]) -> None:
        """Make `pages` readable by transfers (nothing to do: they read the pool itself)."""

    def stage_in(self, pages: Sequence[int]) -> None:
        """Take `pages` that transfers wrote (nothing to do: they wrote the pool itself)."""

    def gather(self, pages: Sequence[int]) -> torch.Tensor:
        """Copies of whole pages, [len(pages), page_bytes] uint8 (each byte once, in order)."""
        index = torch.tensor(list(pages), dtype=torch.long)
        if not self.sharded:
            return self.pools[0][index]
        runs = self.layout.side([0]).runs()
        return torch.cat([self.pools[s][index, at : at + n] for s, at, n in runs], dim=1)


class StagedKvPages(KvPages):
    """One pool (single rank) reached by transfers through a host mirror of it."""

    staged = True

    def __init__(self, cache: PagedKVCache) -> None:
        self.pool = cache.pool
        pinned = cache.pool.is_cuda  # page-locked: the copies run at the bus's speed
        mirror = torch.zeros(cache.pool.shape, dtype=torch.uint8, pin_memory=pinned)
        super().__init__(cache.spec, [mirror], [(range(cache.spec.page_bytes),)], mirror)

    def stage_out(self, pages: Sequence[int]) -> None:
        for first, stop in _runs(pages):
            self.region[first:stop].copy_(self.pool[first:stop])

    def stage_in(self, pages: Sequence[int]) -> None:
        for first, stop in _runs(pages):
            self.pool[first:stop].copy_(self.region[first:stop])

    def gather(self, pages: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(list(pages), dtype=torch.long, device=self.pool.device)
        return self.pool[index].cpu()


def _runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """[first, stop) of each run of consecutive page ids, in order."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][1] == page:
            runs[-1] = (runs[-1][0], page + 1)
        else:
            runs.append((page, page + 1))
    return runs
