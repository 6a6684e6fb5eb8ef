"""Where a worker's KV pages lie in memory, shard by shard, and the byte ranges that copy pages
between two such layouts (pure Python: transfer code, routers and tests use it).

A page is head-major (layout.py): [head] x head block, a head block being each layer's data then
each layer's FP8 scales. A worker split over ranks keeps one pool per rank, and rank r's page p
holds some bytes of the logical page p: its KV heads (tensor parallelism) and, within each head
block, its layers (pipeline stages), as `spans` of the whole page laid end to end. Heads only:
one span (a head range is contiguous); a stage's layers: one or two spans per head (data, then
scales). Copying pages from one layout to another (prefill TP=2 -> decode TP=1, a staged worker
-> the KV store's whole pages) is, per page and destination span, one range per source span its
bytes come from, never a per-token copy. Bytes that several source shards hold (MLA's latent
on every rank, KV heads replicated over ranks) are read from one of them, the holders taken in
turn by destination shard; every destination shard gets every byte it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.kv.layout import KVCacheSpec

__all__ = [
    "PageSide",
    "PoolLayout",
    "PoolShard",
    "copy_ranges",
    "copy_ranges_by_shard",
    "shard_spans",
]


@dataclass(frozen=True)
class PoolShard:
    """One rank's pool: page p of it (its spans' bytes end to end) starts at address + p *
    page_bytes; `session`: the transfer session that reaches it ("": the worker's own)."""

    address: int
    spans: tuple[range, ...]
    session: str = ""

    @property
    def page_bytes(self) -> int:
        return sum(len(span) for span in self.spans)


@dataclass(frozen=True)
class PoolLayout:
    """A worker's page pool: its shards (rank order) and the logical page's size; every byte of
    the page is held by at least one shard."""

    shards: tuple[PoolShard, ...]
    page_bytes: int

    def __post_init__(self) -> None:
        held = sorted((span.start, span.stop) for s in self.shards for span in s.spans)
        reach = 0
        for start, stop in held:
            if start > reach or stop <= start:
                break
            reach = max(reach, stop)
        if reach != self.page_bytes or held[-1][1] > self.page_bytes:
            raise ValueError(f"shards {self.shards} do not hold a page of {self.page_bytes} B")

    @classmethod
    def whole(cls, address: int, page_bytes: int) -> PoolLayout:
        """One pool of whole pages."""
        return cls((PoolShard(address, (range(page_bytes),)),), page_bytes)

    def side(self, pages: Sequence[int]) -> PageSide:
        """`pages` of this pool as one side of a copy."""
        starts = tuple(tuple(s.address + p * s.page_bytes for p in pages) for s in self.shards)
        return PageSide(tuple(s.spans for s in self.shards), starts)


def shard_spans(spec: KVCacheSpec, heads: range, layers: range) -> tuple[range, ...]:
    """The bytes of a whole page (of `spec`) that a rank with these KV heads and layers holds,
    in the order of its own page (heads, then per head the layers' data, then their scales);
    neighbouring spans merged."""
    out: list[range] = []
    block, first, stop = spec.head_block_bytes, layers.start, layers.stop
    for head in heads:
        base = head * block
        parts = [(spec.data_offset(first), spec.data_offset(stop))]
        if spec.quantized:
            parts.append((spec.scale_offset(first), spec.scale_offset(stop)))
        for a, b in parts:
            if out and out[-1].stop == base + a:
                out[-1] = range(out[-1].start, base + b)
            else:
                out.append(range(base + a, base + b))
    return tuple(out)


@dataclass(frozen=True)
class PageSide:
    """Pages on one side of a copy: per shard, the spans of the logical page it holds (end to
    end in its own page) and where each of its pages starts."""

    spans: tuple[tuple[range, ...], ...]
    starts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.spans) != len(self.starts) or len({len(s) for s in self.starts}) > 1:
            raise ValueError("every shard of a page side needs one start per page")

    @classmethod
    def whole(cls, addresses: Sequence[int], page_bytes: int) -> PageSide:
        """Whole pages at `addresses` (a KV store's, a staging buffer's)."""
        return cls(((range(page_bytes),),), (tuple(addresses),))

    def __len__(self) -> int:
        return len(self.starts[0])

    def select(self, indices: Sequence[int]) -> PageSide:
        """These pages of the side, in this order."""
        return PageSide(self.spans, tuple(tuple(s[i] for i in indices) for s in self.starts))

    @property
    def page_bytes(self) -> int:
        return max(span.stop for spans in self.spans for span in spans)

    def runs(self) -> list[tuple[int, int, int]]:
        """(shard, offset in its page, bytes) runs that make a whole page, in order, each byte
        from the first shard holding it."""
        return [
            (s, offset, n)
            for s, offset, n, _ in _runs(_held(self.spans), range(self.page_bytes), 0)
        ]

    def pieces(self, index: int) -> list[tuple[int, int]]:
        """(address, length) of page `index`'s bytes in order (see runs)."""
        return [(self.starts[s][index] + offset, n) for s, offset, n in self.runs()]


Ranges = tuple[list[int], list[int], list[int]]


def copy_ranges(src: PageSide, dst: PageSide) -> Ranges:
    """Source addresses, destination addresses and lengths that copy page i of `src` into page
    i of `dst` for every i (the same logical pages, possibly split differently)."""
    out: Ranges = ([], [], [])
    for part in copy_ranges_by_shard(src, dst, "dst").values():
        for mine, theirs in zip(out, part, strict=True):
            mine.extend(theirs)
    return out


def copy_ranges_by_shard(src: PageSide, dst: PageSide, side: str) -> dict[int, Ranges]:
    """`copy_ranges`, grouped by the shard of the `side` ("src" or "dst") each range is in:
    what one transfer call per remote shard (each its own transfer session) moves."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    held = _held(src.spans)
    out: dict[int, Ranges] = {}
    for d, spans in enumerate(dst.spans):
        local = 0
        for span in spans:
            for s, s_off, n, at in _runs(held, span, d):
                d_off = local + at - span.start
                part = out.setdefault(s if side == "src" else d, ([], [], []))
                part[0].extend(start + s_off for start in src.starts[s])
                part[1].extend(start + d_off for start in dst.starts[d])
                part[2].extend([n] * len(src))
            local += len(span)
    return out


def _held(spans: tuple[tuple[range, ...], ...]) -> list[tuple[int, range, int]]:
    """(shard, span, its offset in the shard's page) for every span of every shard."""
    out = []
    for shard, shard_spans_ in enumerate(spans):
        local = 0
        for span in shard_spans_:
            out.append((shard, span, local))
            local += len(span)
    return out


def _runs(
    held: list[tuple[int, range, int]], wanted: range, turn: int
) -> list[tuple[int, int, int, int]]:
    """(shard, offset in its page, bytes, first byte) runs covering the `wanted` bytes, each
    byte from a shard holding it: the `turn`-th of its holders (destinations spread over
    replicas)."""
    out, at = [], wanted.start
    while at < wanted.stop:
        holders = [(s, span, local) for s, span, local in held if at in span]
        if not holders:
            raise ValueError(f"byte {at} of the page is in no shard")
        s, span, local = holders[turn % len(holders)]
        end = min(wanted.stop, span.stop)
        out.append((s, local + at - span.start, end - at, at))
        at = end
    return out
