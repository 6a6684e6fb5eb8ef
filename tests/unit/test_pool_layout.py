"""Copies between page pools split differently over ranks (kv/pool_layout.py): by KV heads
(tensor parallelism), by layers (pipeline stages), replicated; every byte of every page lands
where the destination layout keeps it."""

import numpy as np
import pytest
import torch

from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.kv.pool_layout import (
    PageSide,
    PoolLayout,
    PoolShard,
    copy_ranges,
    copy_ranges_by_shard,
    shard_spans,
)
from kvmesh.engine.pool.kv_pages import KvPages

HEAD = 8  # bytes of one head block
HEADS = 6


class Memory:
    """One flat byte space: an address is an offset into it."""

    def __init__(self) -> None:
        self.bytes = np.zeros(1 << 16, np.uint8)
        self.top = 64

    def pool(self, splits: list, pages: int, page_bytes: int = HEADS * HEAD) -> PoolLayout:
        """Shards holding these head ranges (or these tuples of byte spans)."""
        shards = []
        for split in splits:
            spans = (
                split
                if isinstance(split, tuple)
                else (range(split.start * HEAD, split.stop * HEAD),)
            )
            shards.append(PoolShard(self.top, spans))
            self.top += pages * shards[-1].page_bytes + 32  # a gap: no run into a neighbour
        return PoolLayout(tuple(shards), page_bytes)

    def copy(self, src: list[int], dst: list[int], lengths: list[int]) -> None:
        for s, d, n in zip(src, dst, lengths, strict=True):
            self.bytes[d : d + n] = self.bytes[s : s + n]

    def page(self, side: PageSide, index: int) -> bytes:
        return b"".join(self.bytes[a : a + n].tobytes() for a, n in side.pieces(index))

    def fill(self, side: PageSide, pages: list[bytes]) -> None:
        """Write whole logical pages into every shard holding each byte."""
        for i, page in enumerate(pages):
            for spans, starts in zip(side.spans, side.starts, strict=True):
                self.bytes[starts[i] : starts[i] + sum(map(len, spans))] = np.frombuffer(
                    b"".join(page[r.start : r.stop] for r in spans), np.uint8
                )

    def holds(self, side: PageSide, pages: list[bytes]) -> bool:
        """Every shard of `side` holds its bytes of each page (replicas too)."""
        return all(
            self.bytes[starts[i] : starts[i] + sum(map(len, spans))].tobytes()
            == b"".join(page[r.start : r.stop] for r in spans)
            for i, page in enumerate(pages)
            for spans, starts in zip(side.spans, side.starts, strict=True)
        )


def _pages(count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, HEADS * HEAD, np.uint8).tobytes() for _ in range(count)]


SPLITS = {
    "tp1": [range(0, 6)],
    "tp2": [range(0, 3), range(3, 6)],
    "tp4_uneven": [range(0, 1), range(1, 3), range(3, 4), range(4, 6)],
    "replicated": [range(0, 6), range(0, 6)],  # MLA's latent on two ranks
    "halves_replicated": [range(0, 3), range(0, 3), range(3, 6), range(3, 6)],
}


@pytest.mark.parametrize("src_name", sorted(SPLITS))
@pytest.mark.parametrize("dst_name", sorted(SPLITS))
def test_copy_between_any_two_layouts(src_name: str, dst_name: str) -> None:
    memory = Memory()
    src_pool, dst_pool = memory.pool(SPLITS[src_name], 8), memory.pool(SPLITS[dst_name], 8)
    src, dst = src_pool.side([5, 1, 2]), dst_pool.side([0, 7, 3])
    pages = _pages(3, 1)
    memory.fill(src, pages)
    out = copy_ranges(src, dst)
    memory.copy(*out)
    assert memory.holds(dst, pages)  # every replica too
    if src_name != "replicated" and "replicated" not in dst_name:  # one range per overlap
        per_page = len(out[0]) // 3
        assert per_page <= len(src.spans) + len(dst.spans) - 1


def test_replicas_are_read_in_turn() -> None:
    memory = Memory()
    src = memory.pool(SPLITS["replicated"], 4).side([0])
    dst = memory.pool(SPLITS["replicated"], 4).side([0])
    sources, _, _ = copy_ranges(src, dst)
    assert sources == [src.starts[0][0], src.starts[1][0]]  # destination rank r from replica r


def test_whole_pages_and_a_sharded_pool() -> None:
    memory = Memory()
    sharded = memory.pool(SPLITS["tp2"], 4).side([2, 3])
    store = PageSide.whole([30000, 30000 + HEADS * HEAD], HEADS * HEAD)
    pages = _pages(2, 2)
    memory.fill(store, pages)
    memory.copy(*copy_ranges(store, sharded))
    assert [memory.page(sharded, i) for i in range(2)] == pages
    assert len(sharded.pieces(0)) == 2 and sharded.page_bytes == HEADS * HEAD


def test_ranges_grouped_by_the_remote_shard_make_the_same_copy() -> None:
    """One transfer call per remote shard (each its own session): the groups of a copy are its
    ranges, each group's addresses inside that shard's pages."""
    memory = Memory()
    sharded = memory.pool(SPLITS["tp2"], 4).side([2, 3])
    store = PageSide.whole([30000, 30000 + HEADS * HEAD], HEADS * HEAD)
    for src, dst, side, remote in (
        (store, sharded, "dst", sharded),
        (sharded, store, "src", sharded),
    ):
        groups = copy_ranges_by_shard(src, dst, side)
        assert sorted(groups) == [0, 1]
        flat = tuple(sorted(zip(*copy_ranges(src, dst), strict=True)))
        merged = sorted(t for g in groups.values() for t in zip(*g, strict=True))
        assert tuple(merged) == flat
        for shard, (sources, destinations, _) in groups.items():
            addresses = destinations if side == "dst" else sources
            size = sum(len(span) for span in remote.spans[shard])
            first, last = remote.starts[shard][0], remote.starts[shard][-1] + size
            assert all(first <= a < last for a in addresses)


def test_mismatches_are_refused() -> None:
    memory = Memory()
    pool = memory.pool(SPLITS["tp2"], 4)
    with pytest.raises(ValueError, match="2 source pages but 1"):
        copy_ranges(pool.side([0, 1]), pool.side([0]))
    with pytest.raises(ValueError, match="in no shard"):
        copy_ranges(PageSide.whole([0], 3 * HEAD), pool.side([0]))
    with pytest.raises(ValueError, match="do not hold a page"):
        PoolLayout(
            (PoolShard(0, (range(2 * HEAD),)), PoolShard(100, (range(3 * HEAD, 48),))), HEADS * HEAD
        )


def test_kv_pages_gathers_whole_pages_from_shards() -> None:
    spec = KVCacheSpec.gqa(2, HEADS, 4, 2, "fp32")
    whole = torch.randint(0, 255, (6, spec.page_bytes), dtype=torch.uint8)
    hb = spec.head_block_bytes
    pools = [whole[:, : 2 * hb].clone(), whole[:, 2 * hb :].clone()]
    pages = KvPages(spec, pools, [(range(2 * hb),), (range(2 * hb, 6 * hb),)], pools[0])
    assert pages.sharded
    assert torch.equal(pages.gather([4, 1]), whole[[4, 1]])
    one = KvPages(spec, [whole], [(range(spec.page_bytes),)], whole)
    assert torch.equal(one.gather([3]), whole[[3]])


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
def test_pipeline_stages_and_heads_to_any_layout(kv_dtype: str) -> None:
    """A page of 3 layers x 4 heads (FP8: data then scales per head block) held by 2 stages x 2
    tensor ranks, copied into one pool and back into 3 stages x 1 rank: byte for byte."""
    spec = KVCacheSpec.gqa(3, 4, 2, 2, kv_dtype)
    by = {  # rank -> (heads, layers)
        "tp2pp2": [
            (range(0, 2), range(0, 2)),
            (range(2, 4), range(0, 2)),
            (range(0, 2), range(2, 3)),
            (range(2, 4), range(2, 3)),
        ],
        "pp3": [(range(4), range(i, i + 1)) for i in range(3)],
    }
    memory = Memory()
    layouts = {
        k: memory.pool([shard_spans(spec, h, lay) for h, lay in v], 4, spec.page_bytes)
        for k, v in by.items()
    }
    whole = memory.pool([(range(spec.page_bytes),)], 4, spec.page_bytes)
    assert shard_spans(spec, range(4), range(3)) == (range(spec.page_bytes),)  # merged
    assert len(shard_spans(spec, range(0, 2), range(0, 2))) == (2 if kv_dtype == "fp32" else 4)
    rng = np.random.default_rng(3)
    pages = [rng.integers(0, 256, spec.page_bytes, np.uint8).tobytes() for _ in range(2)]
    src = layouts["tp2pp2"].side([1, 3])
    memory.fill(src, pages)
    middle, end = whole.side([2, 0]), layouts["pp3"].side([0, 1])
    memory.copy(*copy_ranges(src, middle))
    memory.copy(*copy_ranges(middle, end))
    assert memory.holds(middle, pages) and memory.holds(end, pages)
    assert [memory.page(end, i) for i in range(2)] == pages


def test_a_destinations_shards_are_checked_before_any_copy() -> None:
    """KvDestination.shards come from another worker: spans ordered, disjoint, bounded and
    covering the page, or the request is refused (never a huge or wrong copy plan)."""
    from kvmesh.mesh.convert import MAX_SPANS, check_shards
    from kvmesh.proto.v1 import prefill_pb2

    def dest(*shards) -> prefill_pb2.KvDestination:
        return prefill_pb2.KvDestination(
            page_bytes=48,
            shards=[
                prefill_pb2.KvShard(
                    address=1000 * i, starts=[a for a, _ in s], stops=[b for _, b in s]
                )
                for i, s in enumerate(shards)
            ],
        )

    check_shards(dest([(0, 16), (32, 48)], [(16, 32)]))  # interleaved heads: fine
    check_shards(dest([(0, 48)], [(0, 48)]))  # replicated
    bad = {
        "ordered and disjoint": dest([(16, 32), (0, 16), (32, 48)]),
        "do not hold a page": dest([(0, 16)], [(32, 48)]),
        "none empty": dest([(0, 0), (0, 48)]),
        "as many span starts": dest([]),
    }
    for reason, message in bad.items():
        with pytest.raises(ValueError, match=reason):
            check_shards(message)
    flood = dest([(i, i + 1) for i in range(MAX_SPANS)] + [(MAX_SPANS, 48)])
    with pytest.raises(ValueError, match="spans"):
        check_shards(flood)
