"""KV store tiers and store logic without a transfer engine: LRU, demotion, promotion, digests."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.kvstore.store import (
    KVStore,
    LayoutMismatchError,
    ReservationNotFoundError,
    StoreConfig,
)
from services.kvstore.tiers import DiskTier, RamTier, TieredPages, page_digest

PAGE = 64
LAYOUT = "tiny|4|fp32"


def fill(ram: RamTier, slot: int, value: int) -> None:
    ram.pool[slot].fill_(value)


def put(pages: TieredPages, block_hash: int, value: int) -> None:
    slot = pages.claim()
    assert slot is not None
    fill(pages.ram, slot, value)
    assert pages.add(block_hash, slot)


def value_of(pages: TieredPages, block_hash: int) -> int | None:
    hit = pages.find(block_hash)
    if hit is None:
        return None
    data = bytes(pages.ram.buffer(hit.slot))
    assert data == bytes([data[0]]) * PAGE
    return data[0]


def tiers(tmp_path: Path, ram_pages: int, disk_pages: int = 0) -> TieredPages:
    disk = DiskTier(tmp_path / "disk", disk_pages, PAGE) if disk_pages else None
    return TieredPages(RamTier(ram_pages, PAGE), disk)


def test_lru_evicts_least_recently_used(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=3)
    for h in (1, 2, 3):
        put(pages, h, h)
    assert value_of(pages, 1) == 1  # 1 is now most recent: 2 is the oldest
    put(pages, 4, 4)
    assert 2 not in pages and {1, 3, 4} <= {h for h in (1, 3, 4) if h in pages}
    put(pages, 5, 5)
    assert 3 not in pages
    assert pages.totals.ram.evictions == 2
    pages.ram.check_integrity()


def test_eviction_moves_to_disk_and_promotion_restores_bytes(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=2, disk_pages=4)
    for h in (10, 11, 12):
        put(pages, h, h)
    assert 10 in pages.disk and 10 not in pages.ram
    assert pages.disk.path(10).stat().st_size == PAGE + 8
    assert value_of(pages, 10) == 10  # promoted; 11 (the LRU) went to disk
    assert 10 in pages.ram and 10 not in pages.disk and 11 in pages.disk
    assert pages.totals.promotions == 1 and pages.totals.disk.hits == 1
    assert value_of(pages, 11) == 11 and value_of(pages, 12) == 12
    pages.ram.check_integrity()


def test_disk_capacity_deletes_oldest_files(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=1, disk_pages=2)
    for h in (1, 2, 3, 4):
        put(pages, h, h)
    assert len(pages.disk) == 2 and 1 not in pages and 2 in pages.disk and 3 in pages.disk
    assert not pages.disk.path(1).exists()
    assert pages.totals.disk.evictions == 1
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == [
        pages.disk.path(2).name,
        pages.disk.path(3).name,
    ]


def test_corrupted_disk_file_is_a_miss(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=1, disk_pages=4)
    put(pages, 1, 7)
    put(pages, 2, 8)
    path = pages.disk.path(1)
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0xFF
    path.write_bytes(raw)
    assert pages.find(1) is None
    assert 1 not in pages and not path.exists()
    assert pages.totals.corrupt_pages == 1 and pages.totals.disk.misses == 1
    assert value_of(pages, 2) == 8
    pages.ram.check_integrity()


def test_truncated_disk_file_is_a_miss(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=1, disk_pages=4)
    put(pages, 1, 7)
    put(pages, 2, 8)
    pages.disk.path(1).write_bytes(pages.disk.path(1).read_bytes()[:-1])
    assert pages.find(1) is None


def test_pinned_pages_are_not_evicted(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=2)
    put(pages, 1, 1)
    put(pages, 2, 2)
    pages.ram.pin(1)  # the oldest, but pinned
    put(pages, 3, 3)
    assert 1 in pages.ram and 2 not in pages
    pages.ram.pin(3)
    assert pages.claim() is None  # everything pinned
    pages.ram.unpin(3)
    pages.ram.unpin(1)  # 1 back as most recent: 3 is now the LRU
    put(pages, 4, 4)
    assert 3 not in pages and 1 in pages
    pages.ram.check_integrity()


def test_digest_mismatch_on_add_releases_the_slot(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=2)
    slot = pages.claim()
    fill(pages.ram, slot, 5)
    assert not pages.add(9, slot, expected=page_digest(bytes(PAGE)))
    assert 9 not in pages
    pages.ram.check_integrity()


def test_disk_tier_reindexes_existing_files(tmp_path: Path) -> None:
    pages = tiers(tmp_path, ram_pages=1, disk_pages=4)
    for h in (1, 2, 3):
        put(pages, h, h)
    reopened = TieredPages(RamTier(1, PAGE), DiskTier(tmp_path / "disk", 4, PAGE))
    assert value_of(reopened, 1) == 1 and value_of(reopened, 2) == 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store(tmp_path: Path, ram_pages: int = 4, disk_pages: int = 0) -> tuple[KVStore, Clock]:
    clock = Clock()
    config = StoreConfig(
        LAYOUT, PAGE, ram_pages * PAGE, disk_pages * PAGE, tmp_path / "d", 30.0, 60.0
    )
    return KVStore(config, None, clock), clock


def offer(kv: KVStore, hashes: list[int]) -> int:
    reserved = kv.reserve(hashes, PAGE, LAYOUT)
    for h, slot_address in zip(reserved.accepted, reserved.addresses, strict=True):
        slot = (slot_address - kv.pages.ram.pool.data_ptr()) // PAGE
        kv.pages.ram.pool[slot].fill_(h)
    return kv.commit(reserved.reservation_id).committed if reserved.reservation_id else 0


def test_store_lookup_leases_and_leading_run(tmp_path: Path) -> None:
    kv, clock = store(tmp_path)
    assert offer(kv, [1, 2, 3]) == 3
    assert offer(kv, [2, 3, 4]) == 1  # 2 and 3 are stored already
    found = kv.lookup([1, 2, 9, 3], PAGE, LAYOUT)
    assert [h.block_hash for h in found.hits] == [1, 2] and found.lease_id
    assert offer(kv, [5, 6, 7]) == 2  # 1 and 2 pinned, 3 and 4 evicted: room for two
    assert kv.release(found.lease_id) and not kv.release(found.lease_id)
    again = kv.lookup([1], PAGE, LAYOUT)
    clock.now = 31.0  # the lease expires without Release
    assert kv.stats().leases == 0 and not kv.release(again.lease_id)
    kv.check_integrity()


def test_store_uncommitted_reservation_is_invisible_and_expires(tmp_path: Path) -> None:
    kv, clock = store(tmp_path, ram_pages=2)
    reserved = kv.reserve([1, 2, 3], PAGE, LAYOUT)
    assert reserved.accepted == [1, 2]  # no room for 3
    assert kv.lookup([1], PAGE, LAYOUT).hits == []
    assert kv.reserve([1, 2], PAGE, LAYOUT).accepted == []  # already reserved
    clock.now = 61.0
    with pytest.raises(ReservationNotFoundError):
        kv.commit(reserved.reservation_id)
    assert offer(kv, [1, 2]) == 2
    kv.check_integrity()


def test_store_rejects_other_layouts(tmp_path: Path) -> None:
    kv, _ = store(tmp_path)
    with pytest.raises(LayoutMismatchError):
        kv.lookup([1], PAGE, "other|4|fp32")
    with pytest.raises(LayoutMismatchError):
        kv.reserve([1], PAGE * 2, LAYOUT)


def test_store_stats_and_temp_dir_removed_on_close(tmp_path: Path) -> None:
    kv = KVStore(StoreConfig(LAYOUT, PAGE, 2 * PAGE, 4 * PAGE))
    disk_dir = kv.pages.disk.directory
    try:
        assert offer(kv, [1, 2, 3]) == 2  # a reservation fits in RAM
        assert offer(kv, [3]) == 1  # 1 goes to disk
        assert [h.tier for h in kv.lookup([3, 1], PAGE, LAYOUT).hits] == ["ram", "disk"]
        stats = kv.stats()
        assert [(t.tier, t.pages) for t in stats.tiers] == [("ram", 2), ("disk", 1)]
        assert stats.promotions == 1 and stats.leases == 1
    finally:
        kv.close()
    assert not disk_dir.exists()
