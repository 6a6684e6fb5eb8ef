"""Where a worker's KV pages lie in memory, shard by shard, and the byte ranges that copy pages
between two such layouts (pure Python: transfer code, routers and tests use it).

A page is head-major (layout.py): [head] x head block. A worker whose KV heads are split over
tensor-parallel ranks keeps one pool per rank, and rank r's page p holds heads [first, first +
count) of the logical page p as one byte range. Copying pages from one layout to another
(prefill TP=2 -> decode TP=1, a TP=2 worker -> the KV store's whole pages) is then, per page and
destination shard, one range per source shard its heads come from: at most (source shards +
destination shards - 1) ranges a page, never a per-token copy. A head that several source shards
hold (MLA's latent, KV heads replicated over ranks) is read from one of them, the holders taken
in turn by destination shard; every destination shard gets every head it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PageSide", "PoolLayout", "PoolShard", "copy_ranges"]


@dataclass(frozen=True)
class PoolShard:
    """One rank's pool: page p of it starts at address + p * num_heads * head bytes."""

    address: int
    first_head: int
    num_heads: int

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)


@dataclass(frozen=True)
class PoolLayout:
    """A worker's page pool: its shards (rank order), each head's block bytes and the logical
    page's head count (every head held by at least one shard)."""

    shards: tuple[PoolShard, ...]
    head_bytes: int
    num_heads: int

    def __post_init__(self) -> None:
        held = set()
        for shard in self.shards:
            if shard.num_heads < 1 or shard.first_head < 0 or shard.heads.stop > self.num_heads:
                raise ValueError(f"shard {shard} outside the page's {self.num_heads} heads")
            held.update(shard.heads)
        if self.head_bytes < 1 or len(held) != self.num_heads:
            raise ValueError(f"shards {self.shards} do not hold all {self.num_heads} heads")

    @classmethod
    def whole(cls, address: int, num_heads: int, head_bytes: int) -> PoolLayout:
        """One pool of whole pages."""
        return cls((PoolShard(address, 0, num_heads),), head_bytes, num_heads)

    @property
    def page_bytes(self) -> int:
        """Bytes of one logical page (every head once)."""
        return self.num_heads * self.head_bytes

    def side(self, pages: Sequence[int]) -> PageSide:
        """`pages` of this pool as one side of a copy."""
        hb = self.head_bytes
        spans = tuple(range(s.first_head * hb, s.heads.stop * hb) for s in self.shards)
        starts = tuple(tuple(s.address + p * s.num_heads * hb for p in pages) for s in self.shards)
        return PageSide(spans, starts)


@dataclass(frozen=True)
class PageSide:
    """Pages on one side of a copy: per shard, the bytes of the logical page it holds (a
    contiguous span: its heads) and where each page of it starts."""

    spans: tuple[range, ...]
    starts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.spans) != len(self.starts) or len({len(s) for s in self.starts}) > 1:
            raise ValueError("every shard of a page side needs one start per page")

    @classmethod
    def whole(cls, addresses: Sequence[int], page_bytes: int) -> PageSide:
        """Whole pages at `addresses` (a KV store's, a staging buffer's)."""
        return cls((range(page_bytes),), (tuple(addresses),))

    def __len__(self) -> int:
        return len(self.starts[0])

    def select(self, indices: Sequence[int]) -> PageSide:
        """These pages of the side, in this order."""
        return PageSide(self.spans, tuple(tuple(s[i] for i in indices) for s in self.starts))

    @property
    def page_bytes(self) -> int:
        return max(span.stop for span in self.spans)

    def runs(self) -> list[tuple[int, int, int]]:
        """(shard, offset in its page, bytes) runs that make a whole page, in order, each byte
        from the first shard holding it."""
        return _runs(self.spans, range(self.page_bytes), 0)

    def pieces(self, index: int) -> list[tuple[int, int]]:
        """(address, length) of page `index`'s bytes in order (see runs)."""
        return [(self.starts[s][index] + offset, n) for s, offset, n in self.runs()]


def copy_ranges(src: PageSide, dst: PageSide) -> tuple[list[int], list[int], list[int]]:
    """Source addresses, destination addresses and lengths that copy page i of `src` into page
    i of `dst` for every i (the same logical pages, possibly split differently)."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    out_src, out_dst, lengths = [], [], []
    for d, span in enumerate(dst.spans):
        for s, s_off, n in _runs(src.spans, span, d):
            d_off = s_off + src.spans[s].start - span.start
            out_src.extend(start + s_off for start in src.starts[s])
            out_dst.extend(start + d_off for start in dst.starts[d])
            lengths.extend([n] * len(src))
    return out_src, out_dst, lengths


def _runs(held: tuple[range, ...], wanted: range, turn: int) -> list[tuple[int, int, int]]:
    """(shard, offset in it, bytes) runs covering the `wanted` bytes: each byte from a shard
    holding it, the `turn`-th of its holders (in turn, so destinations spread over replicas)."""
    out, at = [], wanted.start
    while at < wanted.stop:
        holders = [s for s, span in enumerate(held) if at in span]
        if not holders:
            raise ValueError(f"byte {at} of the page is in no shard")
        s = holders[turn % len(holders)]
        end = min(wanted.stop, held[s].stop)
        out.append((s, at - held[s].start, end - at))
        at = end
    return out
