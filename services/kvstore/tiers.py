"""The KV store's tiers: a RAM pool of fixed-size pages over a directory of page files.

A committed page lives in exactly one tier. RAM: one contiguous uint8 tensor (registered with the
transfer engine by the caller), an O(1) LRU of unpinned pages and a table of pinned ones (a
pinned page is out of the LRU, so eviction never scans past it). Evicting a RAM page moves it to
the disk tier when there is one, else drops it; a disk hit is promoted back into RAM. Every page
carries the xxh3_64 digest of its bytes, checked again whenever it is read back from disk: a
mismatch drops the page (a miss, never wrong bytes).

Slot accounting: free + cached (LRU + pinned) + claimed == num_pages, where a claimed slot was
handed out by `claim` (a reservation being written) and not yet `store`d or `release`d.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import structlog
import torch
import xxhash

log = structlog.get_logger(__name__)

DIGEST_BYTES = 8
_SUFFIX = ".kvpage"


def page_digest(data: object) -> int:
    """xxh3_64 of a page's bytes (any buffer: bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


class CachedPage(NamedTuple):
    slot: int
    digest: int


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class TierTotals:
    """Counters of the whole store (live values; read under the store's lock)."""

    ram: TierCounters = field(default_factory=TierCounters)
    disk: TierCounters = field(default_factory=TierCounters)
    promotions: int = 0
    corrupt_pages: int = 0


class Hit(NamedTuple):
    tier: str  # "ram" | "disk" (where it was found; it is in RAM now)
    slot: int
    digest: int  # xxh3_64 of the page bytes as committed


class RamTier:
    """A pool of `num_pages` pages of `page_bytes`; hash -> slot with LRU and pins."""

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if num_pages <= 0 or page_bytes <= 0:
            raise ValueError(f"need num_pages, page_bytes > 0, got {num_pages}, {page_bytes}")
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self.pool = torch.zeros((num_pages, page_bytes), dtype=torch.uint8)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out slot 0 first
        self._lru: OrderedDict[int, CachedPage] = OrderedDict()  # least recently used first
        self._pinned: dict[int, tuple[CachedPage, int]] = {}  # hash -> (page, pin count)
        self._claimed = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru or block_hash in self._pinned

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def address(self, slot: int) -> int:
        return self.pool.data_ptr() + slot * self.page_bytes

    def buffer(self, slot: int) -> memoryview:
        """The slot's bytes, without a copy (writable)."""
        return memoryview(self.pool[slot].numpy())

    def get(self, block_hash: int) -> CachedPage | None:
        """The page, marked most recently used."""
        if block_hash in self._pinned:
            return self._pinned[block_hash][0]
        page = self._lru.get(block_hash)
        if page is not None:
            self._lru.move_to_end(block_hash)
        return page

    def claim_free(self) -> int | None:
        """A free slot, now claimed; None when there is none (see `pop_lru` to make room)."""
        if not self._free:
            return None
        self._claimed += 1
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Give back a claimed slot unused."""
        self._claimed -= 1
        self._free.append(slot)

    def store(self, block_hash: int, slot: int, digest: int) -> None:
        """Turn a claimed slot into a cached page (most recently used)."""
        if block_hash in self:
            raise KeyError(f"page {block_hash:#x} is already cached")
        self._claimed -= 1
        self._lru[block_hash] = CachedPage(slot, digest)

    def pop_lru(self) -> tuple[int, CachedPage] | None:
        """Remove the least recently used unpinned page; its slot becomes claimed by the caller."""
        if not self._lru:
            return None
        self._claimed += 1
        return self._lru.popitem(last=False)

    def pin(self, block_hash: int) -> None:
        if block_hash in self._pinned:
            page, count = self._pinned[block_hash]
            self._pinned[block_hash] = (page, count + 1)
        else:
            self._pinned[block_hash] = (self._lru.pop(block_hash), 1)

    def unpin(self, block_hash: int) -> None:
        page, count = self._pinned[block_hash]
        if count > 1:
            self._pinned[block_hash] = (page, count - 1)
        else:
            del self._pinned[block_hash]
            self._lru[block_hash] = page  # back as most recently used

    def check_integrity(self) -> None:
        slots = [p.slot for p in self._lru.values()] + [p.slot for p, _ in self._pinned.values()]
        assert len(set(slots) | set(self._free)) == len(slots) + len(self._free), "slot reused"
        assert len(self._free) + len(slots) + self._claimed == self.num_pages, "slots leaked"
        assert all(count > 0 for _, count in self._pinned.values())


class DiskTier:
    """One file per page (`<hash>.kvpage` = 8-byte digest + page bytes), LRU by capacity.

    Files found in `directory` at start are indexed (oldest first); they are checked when read.
    """

    def __init__(self, directory: Path, capacity_pages: int, page_bytes: int) -> None:
        if capacity_pages <= 0:
            raise ValueError(f"capacity_pages must be positive, got {capacity_pages}")
        self.directory, self.capacity_pages, self.page_bytes = directory, capacity_pages, page_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> digest, oldest first
        self._scan()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}{_SUFFIX}"

    def put(self, block_hash: int, data: memoryview, digest: int) -> int:
        """Write one page atomically (temp file + rename); returns pages evicted to make room."""
        evicted = 0
        while len(self._lru) >= self.capacity_pages:
            self.drop(next(iter(self._lru)))
            evicted += 1
        tmp = self.directory / f".{block_hash:016x}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(digest.to_bytes(DIGEST_BYTES, "little"))
                f.write(data)
            os.replace(tmp, self.path(block_hash))
        except OSError as exc:  # disk full or gone: the page is dropped instead
            tmp.unlink(missing_ok=True)
            log.warning(
                "kvstore.disk_write_failed", block_hash=f"{block_hash:016x}", error=str(exc)
            )
            return evicted
        self._lru[block_hash] = digest
        return evicted

    def take(self, block_hash: int) -> tuple[memoryview, int] | None:
        """Move a page out of the tier: (bytes, digest), or None (dropped) if it is corrupt."""
        digest = self._lru.pop(block_hash)
        try:
            raw = self.path(block_hash).read_bytes()
        except OSError:
            return None
        finally:
            self.path(block_hash).unlink(missing_ok=True)
        body = memoryview(raw)[DIGEST_BYTES:]
        header = int.from_bytes(raw[:DIGEST_BYTES], "little")
        if len(body) != self.page_bytes or header != digest or page_digest(body) != digest:
            return None
        return body, digest

    def drop(self, block_hash: int) -> None:
        del self._lru[block_hash]
        self.path(block_hash).unlink(missing_ok=True)

    def _scan(self) -> None:
        files = sorted(self.directory.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files[-self.capacity_pages :]:
            try:
                block_hash = int(path.stem, 16)
                with open(path, "rb") as f:
                    self._lru[block_hash] = int.from_bytes(f.read(DIGEST_BYTES), "little")
            except (ValueError, OSError):
                continue
        for path in files[: -self.capacity_pages]:
            path.unlink(missing_ok=True)


class TieredPages:
    """RAM over an optional disk tier: find (with promotion), make room (with demotion), add."""

    def __init__(self, ram: RamTier, disk: DiskTier | None) -> None:
        self.ram, self.disk = ram, disk
        self.totals = TierTotals()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.ram or (self.disk is not None and block_hash in self.disk)

    def find(self, block_hash: int) -> Hit | None:
        """The page's RAM slot, promoting it from disk; None on a miss (or a corrupt file)."""
        page = self.ram.get(block_hash)
        if page is not None:
            self.totals.ram.hits += 1
            return Hit("ram", page.slot, page.digest)
        self.totals.ram.misses += 1
        if self.disk is None:
            return None
        hit = self._promote(block_hash) if block_hash in self.disk else None
        if hit is None:
            self.totals.disk.misses += 1
        else:
            self.totals.disk.hits += 1
        return hit

    def claim(self) -> int | None:
        """A slot for a new page: a free one, else the LRU page's (moved to disk or dropped)."""
        slot = self.ram.claim_free()
        if slot is not None:
            return slot
        victim = self.ram.pop_lru()
        if victim is None:
            return None  # every cached page is pinned and the rest is claimed
        block_hash, page = victim
        self.totals.ram.evictions += 1
        if self.disk is not None:
            self.totals.disk.evictions += self.disk.put(
                block_hash, self.ram.buffer(page.slot), page.digest
            )
        return page.slot

    def add(self, block_hash: int, slot: int, expected: int | None = None) -> bool:
        """Cache the bytes now in claimed `slot` as `block_hash`, with their digest.

        When they do not hash to `expected` the slot is released instead and False returned.
        """
        digest = page_digest(self.ram.buffer(slot))
        if expected is not None and digest != expected:
            self.ram.release(slot)
            return False
        self.ram.store(block_hash, slot, digest)
        return True

    def _promote(self, block_hash: int) -> Hit | None:
        assert self.disk is not None
        taken = self.disk.take(block_hash)  # first: making room in RAM may demote to disk
        if taken is None:
            self.totals.corrupt_pages += 1
            return None
        body, digest = taken
        slot = self.claim()
        if slot is None:  # RAM is all pinned or claimed: the page goes back to disk
            self.disk.put(block_hash, body, digest)
            return None
        self.ram.buffer(slot)[:] = body
        self.ram.store(block_hash, slot, digest)
        self.totals.promotions += 1
        return Hit("disk", slot, digest)
