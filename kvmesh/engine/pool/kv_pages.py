"""A worker's whole page pool as transfers and the KV store see it (kv/pool_layout.py): one
shard per rank (its KV heads, its pipeline stage's layers), rank 0's in its own engine, the
others' in shared memory that rank 0 maps too (parallel/ranks.py), or the one pool of a
single-rank engine.

`--kv-transfer staged` (`StagedKvPages`): transfers see a host mirror of the pool instead of the
pool (a GPU's pages that the non-CUDA transfer engine cannot register). Whoever sends pages
stages them out first (pool -> mirror), whoever received pages stages them in (mirror -> pool):
one copy per run of consecutive page ids. With direct transfers both are no-ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    """Pools reached by transfers through host mirrors of them: this process's pool (a single
    rank's, or rank 0's) and, for a parallel engine, each other rank's, which that rank copies
    in its own process (`others`: parallel/ranks.py `Ranks.stage`, between its GPU pool and its
    part of the shared host block)."""

    staged = True

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: torch.Tensor,
        mirrors: Sequence[torch.Tensor],
        spans: Sequence[tuple[range, ...]],
        region: torch.Tensor,
        others: Callable[[str, list[int]], None] | None = None,
    ) -> None:
        """pool: this process's pool, mirrored by mirrors[0]; others(direction, pages): the
        other ranks' copies ("out": pool -> mirror, "in": mirror -> pool), awaited."""
        super().__init__(spec, mirrors, spans, region)
        self.pool, self.others = pool, others

    @classmethod
    def single(cls, cache: PagedKVCache) -> StagedKvPages:
        """One rank's pool and a mirror of its own (page-locked on a GPU: copies at bus speed)."""
        pool = cache.pool
        mirror = torch.zeros(pool.shape, dtype=torch.uint8, pin_memory=pool.is_cuda)
        return cls(cache.spec, pool, [mirror], [(range(cache.spec.page_bytes),)], mirror)

    def stage_out(self, pages: Sequence[int]) -> None:
        self._stage("out", pages)

    def stage_in(self, pages: Sequence[int]) -> None:
        self._stage("in", pages)

    def _stage(self, direction: str, pages: Sequence[int]) -> None:
        if self.others is not None:
            self.others(direction, list(pages))
        copy_runs(direction, self.pool, self.pools[0], pages)

    def gather(self, pages: Sequence[int]) -> torch.Tensor:
        if self.sharded:  # every rank's bytes: through the mirrors
            self.stage_out(pages)
            return super().gather(pages)
        index = torch.tensor(list(pages), dtype=torch.long, device=self.pool.device)
        return self.pool[index].cpu()


def copy_runs(direction: str, pool: torch.Tensor, mirror: torch.Tensor, pages: Sequence[int]):
    """`pages` of a pool copied to its host mirror ("out") or back ("in"), one copy per run of
    consecutive page ids."""
    for first, stop in _runs(pages):
        if direction == "out":
            mirror[first:stop].copy_(pool[first:stop])
        else:
            pool[first:stop].copy_(mirror[first:stop])


def _runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """[first, stop) of each run of consecutive page ids, in order."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][1] == page:
            runs[-1] = (runs[-1][0], page + 1)
        else:
            runs.append((page, page + 1))
    return runs
