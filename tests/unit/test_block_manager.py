"""Block pool + prefix cache: exact page ids, eviction order, revival, events, invariants."""

from __future__ import annotations

import itertools
import random

import pytest

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv import (
    AllCleared,
    BlockHasher,
    BlockManager,
    BlockManagerConfig,
    FreePageQueue,
    Page,
    PagesRemoved,
    PagesStored,
    PrefixMatch,
)

PS = 4
_ids = itertools.count()


def make_bm(num_pages: int = 8, caching: bool = True) -> BlockManager:
    return BlockManager(BlockManagerConfig(num_pages, PS, caching), BlockHasher(PS, 12345))


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(f"s{next(_ids)}", list(tokens), SamplingParams())


def queue_ids(bm: BlockManager) -> list[int]:
    return [page.page_id for page in bm.free_queue]


def run(bm: BlockManager, seq: Sequence, prefix: bool = False) -> None:
    """Admit seq, compute all its tokens and register its full pages."""
    match = bm.match_prefix(seq) if prefix else None
    todo = seq.num_tokens - (match.num_tokens if match else 0)
    assert bm.allocate(seq, todo, match)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_pages(seq, seq.num_tokens)
    bm.check_integrity()


def test_config_validated() -> None:
    with pytest.raises(ValueError):
        BlockManagerConfig(0)
    with pytest.raises(ValueError):
        BlockManagerConfig(4, page_size=0)
    with pytest.raises(ValueError):
        BlockManager(BlockManagerConfig(4, 8), BlockHasher(4, 0))


def test_free_page_queue_links() -> None:
    pages = [Page(i) for i in range(4)]
    queue = FreePageQueue(pages)
    queue.remove(pages[2])
    queue.appendleft(pages[2])
    queue.remove(pages[0])
    queue.append(pages[0])
    assert [p.page_id for p in queue] == [2, 1, 3, 0] and len(queue) == 4
    assert queue.popleft() is pages[2]
    queue.remove(pages[0])
    queue.remove(pages[1])
    assert [p.page_id for p in queue] == [3] and len(queue) == 1
    assert queue.popleft() is pages[3]
    with pytest.raises(IndexError):
        queue.popleft()


def test_fresh_pool_hands_out_ids_in_order() -> None:
    bm = make_bm()
    a, b = make_seq(list(range(10))), make_seq(list(range(5)))
    assert bm.allocate(a, 10)
    assert bm.allocate(b, 5)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert (bm.num_used_pages, bm.num_free_pages, bm.usage) == (5, 3, 5 / 8)
    bm.check_integrity([a, b])
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2)  # 12 tokens still fit in 3 pages
    assert a.block_table == [0, 1, 2]
    assert bm.allocate(a, 3)  # 15 tokens -> a 4th page
    assert a.block_table == [0, 1, 2, 5]
    bm.check_integrity([a, b])


def test_free_in_reverse_order_hashless_to_front() -> None:
    bm = make_bm()
    a, b = make_seq(list(range(10))), make_seq(list(range(5)))
    bm.allocate(a, 10)
    bm.allocate(b, 5)
    bm.free(a)
    assert queue_ids(bm) == [0, 1, 2, 5, 6, 7]
    bm.free(b)
    assert queue_ids(bm) == [3, 4, 0, 1, 2, 5, 6, 7]
    assert a.block_table == [] and b.block_table == []
    bm.free(a)  # idempotent
    assert queue_ids(bm) == [3, 4, 0, 1, 2, 5, 6, 7]
    bm.check_integrity([a, b])


def test_eviction_order_hashless_first_then_lru_tail_first() -> None:
    bm = make_bm()
    a = make_seq(list(range(12)))
    b = make_seq([50, 51, 52, 53, 54, 55])
    run(bm, a)
    run(bm, b)
    bm.take_events()
    bm.free(a)
    assert queue_ids(bm) == [5, 6, 7, 2, 1, 0]
    bm.free(b)
    assert queue_ids(bm) == [4, 5, 6, 7, 2, 1, 0, 3]
    assert (bm.num_cached_pages, bm.num_free_pages, bm.num_used_pages) == (4, 8, 0)
    c = make_seq([90] * 32)
    assert bm.allocate(c, 32)
    assert c.block_table == [4, 5, 6, 7, 2, 1, 0, 3]
    h = a.block_hashes
    assert bm.take_events() == [PagesRemoved((h[2], h[1], h[0], b.block_hashes[0]))]
    assert bm.num_cached_pages == 0
    bm.check_integrity([c])


def test_prefix_hit_revives_exact_pages() -> None:
    bm = make_bm()
    a = make_seq(list(range(12)))
    run(bm, a)
    bm.free(a)
    assert queue_ids(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    d = make_seq(list(range(8)) + [70, 71, 72])
    match = bm.match_prefix(d)
    assert match == PrefixMatch((0, 1), 8)
    assert bm.num_used_pages == 0  # matching takes no references
    assert bm.allocate(d, 3, match)
    assert d.block_table == [0, 1, 3]
    assert (d.num_computed_tokens, d.num_cached_tokens) == (8, 8)
    assert queue_ids(bm) == [4, 5, 6, 7, 2]
    assert [bm.pages[i].ref_count for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    bm.check_integrity([d])


def test_prefix_shared_with_live_sequence() -> None:
    bm = make_bm()
    a = make_seq(list(range(12)))
    run(bm, a)
    e = make_seq(list(range(12)) + [99])
    match = bm.match_prefix(e)
    assert match == PrefixMatch((0, 1, 2), 12)
    free_before = queue_ids(bm)
    assert bm.allocate(e, 1, match)
    assert e.block_table == [0, 1, 2, 3]
    assert [bm.pages[i].ref_count for i in (0, 1, 2)] == [2, 2, 2]
    assert queue_ids(bm) == free_before[1:]
    bm.check_integrity([a, e])
    bm.free(a)
    assert bm.pages[0].ref_count == 1 and 0 not in queue_ids(bm)
    bm.check_integrity([e])


def test_match_capped_so_one_token_is_computed() -> None:
    bm = make_bm()
    run(bm, make_seq(list(range(16))))
    assert bm.match_prefix(make_seq(list(range(12)))) == PrefixMatch((0, 1), 8)
    assert bm.match_prefix(make_seq(list(range(13)))) == PrefixMatch((0, 1, 2), 12)
    assert bm.match_prefix(make_seq([0])) == PrefixMatch((), 0)
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == PrefixMatch((), 0)


def test_allocate_failure_changes_nothing() -> None:
    bm = make_bm(num_pages=4)
    a = make_seq(list(range(12)))
    run(bm, a)
    bm.take_events()
    b = make_seq([7] * 8)
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and queue_ids(bm) == [3]
    bm.free(a)
    order = queue_ids(bm)
    # 2 cached pages to revive + 3 new pages > 4 free pages: nothing may move.
    c = make_seq(list(range(8)) + [5] * 10)
    match = bm.match_prefix(c)
    assert match.page_ids == (0, 1)
    assert not bm.allocate(c, 10, match)
    assert c.block_table == [] and (c.num_computed_tokens, c.num_cached_tokens) == (0, 0)
    assert queue_ids(bm) == order and bm.num_cached_pages == 3
    assert bm.take_events() == []
    bm.check_integrity([c])
    assert bm.allocate(c, 8, match)  # 2 revived + 2 new fits exactly
    assert c.block_table == [0, 1, 3, 2]
    bm.check_integrity([c])


def test_stale_prefix_rejected() -> None:
    bm = make_bm()
    seq = make_seq(list(range(9)))
    with pytest.raises(ValueError):
        bm.allocate(seq, 1, PrefixMatch((0,), 4))


def test_duplicates_keep_first_registration() -> None:
    bm = make_bm()
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_full_pages(a, 9)
    bm.cache_full_pages(b, 9)
    events = bm.take_events()
    assert events == [PagesStored(tuple(a.block_hashes), None, (0, 1))]
    assert a.block_hashes == b.block_hashes
    assert [bm.pages[i].block_hash for i in b.block_table] == [None, None, None]
    bm.check_integrity([a, b])
    bm.free(b)
    assert queue_ids(bm)[:3] == [3, 4, 5]  # b's duplicate pages are hash-less: front
    bm.free(a)
    assert queue_ids(bm)[-2:] == [1, 0]
    bm.check_integrity()


def test_events_stored_incrementally_then_cleared() -> None:
    bm = make_bm()
    a = make_seq(list(range(14)))
    assert bm.allocate(a, 6)
    a.num_computed_tokens = 6
    bm.cache_full_pages(a, 6)
    h = a.block_hashes
    assert bm.take_events() == [PagesStored((h[0],), None, (0,))]
    assert bm.allocate(a, 8) is True
    a.num_computed_tokens = 14
    bm.cache_full_pages(a, 14)
    assert bm.take_events() == [PagesStored((h[1], h[2]), h[0], (1, 2))]
    bm.cache_full_pages(a, 14)
    assert bm.take_events() == []
    assert not bm.reset_prefix_cache()  # pages in use
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [AllCleared()]
    assert bm.num_cached_pages == 0 and bm.match_prefix(make_seq(list(range(14)))).num_tokens == 0
    bm.check_integrity()


def test_prefix_caching_off() -> None:
    bm = make_bm(caching=False)
    a = make_seq(list(range(12)))
    run(bm, a)
    assert bm.take_events() == [] and bm.num_cached_pages == 0
    assert bm.match_prefix(make_seq(list(range(13)))) == PrefixMatch((), 0)
    bm.free(a)
    assert queue_ids(bm) == list(range(8))


def test_integrity_detects_corruption() -> None:
    bm = make_bm()
    a = make_seq(list(range(8)))
    run(bm, a)
    bm.pages[5].ref_count = 1  # queued page claiming a reference
    with pytest.raises(AssertionError):
        bm.check_integrity()
    bm.pages[5].ref_count = 0
    bm.pages[0].ref_count = 2
    bm.check_integrity()
    with pytest.raises(AssertionError):
        bm.check_integrity([a])


def test_randomized_operations_keep_invariants() -> None:
    rng = random.Random(1234)
    bm = make_bm(num_pages=24)
    live: list[Sequence] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.3 or not live:
            seq = make_seq([rng.randrange(3) for _ in range(rng.randrange(1, 20))])
            match = bm.match_prefix(seq)
            todo = rng.randrange(1, seq.num_tokens - match.num_tokens + 1)
            if bm.allocate(seq, todo, match):
                seq.num_computed_tokens += todo
                bm.cache_full_pages(seq, seq.num_computed_tokens)
                live.append(seq)
            else:
                assert seq.block_table == [] and seq.num_computed_tokens == 0
        elif op < 0.7:
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(3))
            todo = rng.randrange(1, seq.num_tokens - seq.num_computed_tokens + 1)
            table = list(seq.block_table)
            if bm.allocate(seq, todo):
                seq.num_computed_tokens += todo
                bm.cache_full_pages(seq, seq.num_computed_tokens)
            else:
                assert seq.block_table == table
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        for seq in live:
            assert len(seq.block_table) * PS >= seq.num_computed_tokens
        bm.check_integrity(live)
    for seq in live:
        bm.free(seq)
    bm.check_integrity([])
    assert bm.num_used_pages == 0 and bm.num_free_pages == 24


def test_cache_salts_never_share_pages():
    from kvmesh.engine.core.sampling_params import SamplingParams
    from kvmesh.engine.core.sequence import Sequence
    from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig

    manager = BlockManager(
        BlockManagerConfig(num_pages=16, page_size=4), BlockHasher.salted("m", 4, "fp32")
    )
    tokens = list(range(13))
    first = Sequence("a", tokens, SamplingParams(), cache_salt="tenant-a")
    assert manager.allocate(first, len(tokens), manager.match_prefix(first))
    first.num_computed_tokens = len(tokens)
    manager.cache_full_pages(first, len(tokens))
    manager.free(first)
    other = Sequence("b", tokens, SamplingParams(), cache_salt="tenant-b")
    same = Sequence("c", tokens, SamplingParams(), cache_salt="tenant-a")
    unsalted = Sequence("d", tokens, SamplingParams())
    assert manager.match_prefix(other).num_tokens == 0
    assert manager.match_prefix(unsalted).num_tokens == 0
    assert manager.match_prefix(same).num_tokens == 12
    manager.check_integrity()


def test_tags_bump_on_every_new_owner_and_survive_prefix_revival() -> None:
    bm = make_bm()
    a = make_seq(list(range(12)))
    run(bm, a)
    assert a.page_tags == [1, 1, 1]
    assert bm.take_stamps() == [(0, 1), (1, 1), (2, 1)]
    bm.free(a)
    assert a.page_tags == []
    d = make_seq(list(range(8)) + [70, 71, 72])
    assert bm.allocate(d, 3, bm.match_prefix(d))
    assert d.block_table == [0, 1, 3]
    assert d.page_tags == [1, 1, 1]  # pages 0, 1 revived as they were; page 3 is new
    assert bm.take_stamps() == [(3, 1)]
    bm.free(d)
    e = make_seq([90 + i for i in range(16)])  # takes hash-less pages first, then evicts 2, ...
    assert bm.allocate(e, 16)
    assert e.block_table == [3, 4, 5, 6]
    assert e.page_tags == [2, 1, 1, 1]  # page 3's second owner
    assert bm.take_stamps() == [(3, 2), (4, 1), (5, 1), (6, 1)]
    assert bm.take_stamps() == []


def test_tags_cycle_without_zero() -> None:
    from kvmesh.engine.kv.block_manager import TAG_MAX, next_tag

    assert next_tag(0) == 1
    assert next_tag(TAG_MAX - 1) == TAG_MAX
    assert next_tag(TAG_MAX) == 1  # 0 is reserved for "not written yet"


def test_discard_cached_forgets_hashes_and_emits_removal() -> None:
    bm = make_bm()
    a = make_seq(list(range(12)))
    run(bm, a)
    bm.take_events()
    bm.discard_cached([1, 5])
    assert bm.take_events() == [PagesRemoved((a.block_hashes[1],))]
    bm.free(a)
    d = make_seq(list(range(12)))
    assert bm.match_prefix(d) == PrefixMatch((0,), 4)  # page 1 no longer matches
    bm.check_integrity()
