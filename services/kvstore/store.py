"""The KV store's logic: lookups with leases, reservations with commit, behind one lock.

Clients move page bytes with the transfer engine; this module only hands out addresses in the
RAM pool (registered with the engine once) and keeps the index. A reservation's slots are not
visible until Commit; its TTL must exceed the transfer timeout (`MC_TRANSFER_TIMEOUT`, 30 s by
default), because a write that timed out can still land later and must not land in a reused slot.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import structlog

from kvmesh.errors import InvalidRequestError, LayoutMismatchError, ReservationNotFoundError
from kvmesh.mesh.transfer import KvTransferEngine
from services.kvstore.mooncake_tier import MooncakeTier
from services.kvstore.tiers import DiskTier, RamTier, TieredPages

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    """`layout_key` is "model|page_size|kv_dtype[|kv_spec]" (kvstore_client.layout_key).
    disk_bytes 0 = no disk tier; disk_dir None with a disk tier = a temporary directory removed
    on close. `backend` "mooncake" puts the second tier (disk_bytes of pages) in Mooncake Store
    behind the master at `mooncake_master`."""

    layout_key: str
    page_bytes: int
    ram_bytes: int
    disk_bytes: int = 0
    disk_dir: Path | None = None
    lease_s: float = 30.0
    reservation_s: float = 60.0
    backend: str = "disk"  # "disk" | "mooncake"
    mooncake_master: str = ""  # host:port of a running master ("": none is started for you)

    def __post_init__(self) -> None:
        if self.backend not in ("disk", "mooncake"):
            raise ValueError(f"backend must be 'disk' or 'mooncake', got {self.backend!r}")
        if self.backend == "mooncake" and self.disk_bytes and not self.mooncake_master:
            raise ValueError("backend 'mooncake' needs mooncake_master (host:port)")
        if not self.layout_key:
            raise ValueError("layout_key must not be empty")
        if self.page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {self.page_bytes}")
        if self.ram_bytes < self.page_bytes:
            raise ValueError(f"ram_bytes {self.ram_bytes} < one page ({self.page_bytes})")
        if self.disk_bytes < 0 or self.lease_s <= 0 or self.reservation_s <= 0:
            raise ValueError("disk_bytes must be >= 0, lease_s and reservation_s > 0")

    @property
    def ram_pages(self) -> int:
        return self.ram_bytes // self.page_bytes

    @property
    def disk_pages(self) -> int:
        return self.disk_bytes // self.page_bytes


class PageHit(NamedTuple):
    block_hash: int
    tier: str  # where it was found: "ram" | "disk" (promoted; now in RAM)
    address: int
    digest: int  # xxh3_64 of the page as committed: readers check what they copied


@dataclass(frozen=True)
class LookupResult:
    hits: list[PageHit]
    lease_id: str | None  # None when nothing hit


@dataclass(frozen=True)
class ReserveResult:
    reservation_id: str | None  # None when nothing was accepted
    accepted: list[int]
    addresses: list[int]


class CommitResult(NamedTuple):
    committed: int
    rejected: int


@dataclass(frozen=True)
class TierStat:
    tier: str
    pages: int
    capacity_pages: int
    hits: int
    misses: int
    evictions: int


@dataclass(frozen=True)
class StoreStats:
    tiers: list[TierStat]
    promotions: int
    corrupt_pages: int
    leases: int
    reservations: int


@dataclass
class _Pending:
    """A lease (pinned hashes) or a reservation (claimed slots per hash), until `deadline`."""

    hashes: list[int]
    deadline: float
    slots: list[int] = field(default_factory=list)


class KVStore:
    """Thread-safe: every public method takes the one lock (they may run in worker threads)."""

    def __init__(
        self,
        config: StoreConfig,
        transfer: KvTransferEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.transfer, self._clock = config, transfer, clock
        self._lock = threading.Lock()
        self._temp_dir: Path | None = None
        self.pages = TieredPages(RamTier(config.ram_pages, config.page_bytes), self._disk())
        self._leases: dict[str, _Pending] = {}
        self._reservations: dict[str, _Pending] = {}
        self._reserved: set[int] = set()
        pool = self.pages.ram.pool
        if transfer is not None:
            transfer.register(pool.data_ptr(), pool.numel())
        log.info("kvstore.started", ram_pages=config.ram_pages, disk_pages=config.disk_pages)

    def _disk(self) -> DiskTier | MooncakeTier | None:
        if self.config.disk_pages == 0:
            return None
        if self.config.backend == "mooncake":
            return MooncakeTier(
                self.config.mooncake_master,
                self.config.layout_key,
                self.config.disk_pages,
                self.config.page_bytes,
                None if self.transfer is None else self.transfer.config,
            )
        directory = self.config.disk_dir
        if directory is None:
            directory = self._temp_dir = Path(tempfile.mkdtemp(prefix="kvmesh-kvstore-"))
        return DiskTier(directory, self.config.disk_pages, self.config.page_bytes)

    @property
    def te_session(self) -> str:
        return self.transfer.session if self.transfer is not None else ""

    def lookup(self, block_hashes: Sequence[int], page_bytes: int, layout_key: str) -> LookupResult:
        """The leading run of hashes held (disk hits promoted), pinned under one lease."""
        self._check_layout(page_bytes, layout_key)
        with self._lock:
            self._expire()
            hits = []
            for block_hash in block_hashes:
                hit = self.pages.find(block_hash)
                if hit is None:
                    break
                self.pages.ram.pin(block_hash)  # before the next find can make room
                hits.append(
                    PageHit(block_hash, hit.tier, self.pages.ram.address(hit.slot), hit.digest)
                )
            if not hits:
                return LookupResult([], None)
            lease_id = uuid.uuid4().hex
            deadline = self._clock() + self.config.lease_s
            self._leases[lease_id] = _Pending([h.block_hash for h in hits], deadline)
            return LookupResult(hits, lease_id)

    def release(self, lease_id: str) -> bool:
        """Unpin a lease's pages; False when it is unknown or expired."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            for block_hash in lease.hashes:
                self.pages.ram.unpin(block_hash)
            return True

    def reserve(
        self, block_hashes: Sequence[int], page_bytes: int, layout_key: str
    ) -> ReserveResult:
        """RAM slots for the hashes not stored or reserved yet, in order, while room is found."""
        self._check_layout(page_bytes, layout_key)
        with self._lock:
            self._expire()
            wanted = _new_hashes(block_hashes, self.pages, self._reserved)
            pending = _Pending([], self._clock() + self.config.reservation_s)
            for block_hash in wanted:
                slot = self.pages.claim()
                if slot is None:
                    break
                pending.hashes.append(block_hash)
                pending.slots.append(slot)
            if not pending.hashes:
                return ReserveResult(None, [], [])
            reservation_id = uuid.uuid4().hex
            self._reservations[reservation_id] = pending
            self._reserved.update(pending.hashes)
            addresses = [self.pages.ram.address(slot) for slot in pending.slots]
            return ReserveResult(reservation_id, list(pending.hashes), addresses)

    def commit(self, reservation_id: str, digests: Sequence[int] = ()) -> CommitResult:
        """Index a reservation's pages (digest computed here; checked against `digests` if any)."""
        with self._lock:
            self._expire()
            pending = self._reservations.get(reservation_id)
            if pending is None:
                raise ReservationNotFoundError(f"reservation {reservation_id!r} not found")
            if digests and len(digests) != len(pending.hashes):
                raise InvalidRequestError(
                    f"{len(digests)} digests for {len(pending.hashes)} reserved pages"
                )
            del self._reservations[reservation_id]
            self._reserved.difference_update(pending.hashes)
            expected = list(digests) or [None] * len(pending.hashes)
            stored = sum(
                self.pages.add(block_hash, slot, want)
                for block_hash, slot, want in zip(
                    pending.hashes, pending.slots, expected, strict=True
                )
            )
            return CommitResult(stored, len(pending.hashes) - stored)

    def sweep(self) -> None:
        """Drop expired leases and reservations (also done lazily by every call)."""
        with self._lock:
            self._expire()

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire()
            ram, disk, totals = self.pages.ram, self.pages.disk, self.pages.totals
            tiers = [_tier_stat("ram", len(ram), ram.num_pages, totals.ram)]
            if disk is not None:
                tiers.append(
                    _tier_stat(self.config.backend, len(disk), disk.capacity_pages, totals.disk)
                )
            return StoreStats(
                tiers,
                totals.promotions,
                totals.corrupt_pages,
                len(self._leases),
                len(self._reservations),
            )

    def check_integrity(self) -> None:
        with self._lock:
            self.pages.ram.check_integrity()
            assert sum(len(r.slots) for r in self._reservations.values()) == len(self._reserved)

    def close(self) -> None:
        """Unregister the pool from the transfer engine; remove a temporary disk directory."""
        with self._lock:
            if self.transfer is not None:
                self.transfer.unregister(self.pages.ram.pool.data_ptr())
                self.transfer = None
            if isinstance(self.pages.disk, MooncakeTier):
                self.pages.disk.close()
            if self._temp_dir is not None:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
                self._temp_dir = None

    def _check_layout(self, page_bytes: int, layout_key: str) -> None:
        if layout_key != self.config.layout_key or page_bytes != self.config.page_bytes:
            raise LayoutMismatchError(
                f"pages of layout {layout_key!r} ({page_bytes} B) do not match this store's "
                f"{self.config.layout_key!r} ({self.config.page_bytes} B)"
            )

    def _expire(self) -> None:
        now = self._clock()
        for lease_id in [k for k, v in self._leases.items() if v.deadline <= now]:
            for block_hash in self._leases.pop(lease_id).hashes:
                self.pages.ram.unpin(block_hash)
        for reservation_id in [k for k, v in self._reservations.items() if v.deadline <= now]:
            pending = self._reservations.pop(reservation_id)
            self._reserved.difference_update(pending.hashes)
            for slot in pending.slots:
                self.pages.ram.release(slot)
            log.warning("kvstore.reservation_expired", pages=len(pending.slots))


def _new_hashes(block_hashes: Sequence[int], pages: TieredPages, reserved: set[int]) -> list[int]:
    seen: set[int] = set()
    out = []
    for block_hash in block_hashes:
        if block_hash not in seen and block_hash not in reserved and block_hash not in pages:
            out.append(block_hash)
        seen.add(block_hash)
    return out


def _tier_stat(tier: str, pages: int, capacity: int, counters) -> TierStat:
    return TierStat(tier, pages, capacity, counters.hits, counters.misses, counters.evictions)
