"""A second tier in a Mooncake Store pool (`MooncakeDistributedStore`), in place of the disk tier.

Same interface as `DiskTier`. Key `kv/<layout hash>/<block hash hex>`, value = 8-byte little-endian
digest + page bytes. This process contributes a global segment sized for its own capacity and keeps
the keys it wrote in an LRU; Mooncake may still evict on its own, so a missing value (or one whose
digest does not match) on `take` is a miss, never wrong bytes.

Pitfalls handled here: `put` of an existing key keeps the old value (we `upsert`); `remove` of a
key this client has just read fails while its read lease lasts (such keys are retried later, and
an `upsert` overwrites them anyway); every call after `close()` would segfault (guarded).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import structlog
import xxhash

from kvmesh.errors import MooncakeTierError
from kvmesh.mesh.transfer import TransferConfig
from services.kvstore.tiers import DIGEST_BYTES, page_digest

log = structlog.get_logger(__name__)

_MIN_BYTES = 16 << 20  # Mooncake refuses a segment or a local buffer under 16 MiB
_FILL = 0.8  # stay under Mooncake's eviction high watermark (0.9 of the segment)
_STALE_RETRIES = 8  # stale keys whose removal is retried per put
_NOT_FOUND, _HAS_LEASE = -704, -706  # Mooncake ErrorCode values
_SETUP_RETRIES = "2"  # MC_STORE_CLIENT_SETUP_RETRIES unless set: a missing master fails fast


def segment_bytes(capacity_pages: int, page_bytes: int) -> int:
    """The global segment this tier contributes: its pages under the eviction watermark."""
    need = math.ceil(capacity_pages * (page_bytes + DIGEST_BYTES) / _FILL)
    return max(_MIN_BYTES, -(-need // (1 << 20)) << 20)


class MooncakeTier:
    """`capacity_pages` pages of `page_bytes` in Mooncake Store behind the master at `master`."""

    def __init__(
        self,
        master: str,
        layout_key: str,
        capacity_pages: int,
        page_bytes: int,
        transport: TransferConfig | None = None,
    ) -> None:
        """`transport`: the store's own transfer engine's (its address, protocol and NICs)."""
        if capacity_pages <= 0:
            raise ValueError(f"capacity_pages must be positive, got {capacity_pages}")
        if not master:
            raise ValueError("the mooncake backend needs a master address")
        self.capacity_pages, self.page_bytes = capacity_pages, page_bytes
        self._prefix = f"kv/{xxhash.xxh3_64_hexdigest(layout_key.encode())}/"
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> digest, oldest first
        self._stale: set[str] = set()  # keys no longer indexed, not yet removed from Mooncake
        self._store = _connect(master, capacity_pages, page_bytes, transport)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def key(self, block_hash: int) -> str:
        return f"{self._prefix}{block_hash:016x}"

    def put(self, block_hash: int, data: memoryview, digest: int) -> int:
        """Store one page (overwriting); returns pages evicted to make room. A failed write drops
        the page (logged)."""
        evicted = 0
        while len(self._lru) >= self.capacity_pages:
            self.drop(next(iter(self._lru)))
            evicted += 1
        if self._store is None:
            return evicted
        self._remove_stale()
        key = self.key(block_hash)
        self._stale.discard(key)
        rc = self._store.upsert(key, digest.to_bytes(DIGEST_BYTES, "little") + bytes(data))
        if rc != 0:
            log.warning("kvstore.mooncake_put_failed", block_hash=f"{block_hash:016x}", rc=rc)
            return evicted
        self._lru[block_hash] = digest
        return evicted

    def take(self, block_hash: int) -> tuple[memoryview, int] | None:
        """Move a page out of the tier: (bytes, digest), or None when Mooncake lost or garbled it."""
        digest = self._lru.pop(block_hash)
        if self._store is None:
            return None
        key = self.key(block_hash)
        raw = self._store.get(key)  # b"" when missing (or the master is unreachable)
        if raw:
            self._forget(key)
        body = memoryview(raw)[DIGEST_BYTES:]
        header = int.from_bytes(raw[:DIGEST_BYTES], "little")
        if len(body) != self.page_bytes or header != digest or page_digest(body) != digest:
            return None
        return body, digest

    def drop(self, block_hash: int) -> None:
        del self._lru[block_hash]
        if self._store is not None:
            self._forget(self.key(block_hash))

    def close(self) -> None:
        """Unmount the segment (1-2 s); afterwards the tier is empty and never calls Mooncake."""
        store, self._store = self._store, None
        self._lru.clear()
        self._stale.clear()
        if store is not None:
            store.close()

    def _forget(self, key: str) -> None:
        if self._store is not None and self._store.remove(key) not in (0, _NOT_FOUND):
            self._stale.add(key)  # read-leased (or master down): retried by later puts

    def _remove_stale(self) -> None:
        assert self._store is not None
        for key in list(self._stale)[:_STALE_RETRIES]:
            rc = self._store.remove(key)
            if rc in (0, _NOT_FOUND):
                self._stale.discard(key)
            elif rc != _HAS_LEASE:
                return  # the master is unreachable: do not wait ~4 s per key


def _connect(master: str, capacity_pages: int, page_bytes: int, transport: TransferConfig | None):
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", _SETUP_RETRIES)
    store = MooncakeDistributedStore()
    segment = segment_bytes(capacity_pages, page_bytes)
    buffer = max(_MIN_BYTES, 2 * (page_bytes + DIGEST_BYTES))
    # as this process's transfer engine: its advertised address (not loopback), protocol, NICs
    if transport is None:
        transport = TransferConfig(hostname=os.environ.get("MC_TCP_BIND_ADDRESS", "127.0.0.1"))
    rc = store.setup(
        transport.hostname,
        "P2PHANDSHAKE",
        segment,
        buffer,
        transport.protocol,
        transport.device,
        master,
    )
    if rc != 0:
        raise MooncakeTierError(f"Mooncake Store setup against master {master} failed: rc {rc}")
    log.info("kvstore.mooncake_connected", master=master, segment_bytes=segment)
    return store
