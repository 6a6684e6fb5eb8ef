"""Client of the KV store service: pull cached pages into, and offer pages from, a local pool.

Page bytes move only through the transfer engine; gRPC carries hashes and addresses. Both calls
are best effort: any failure is logged and reported as 0 pages, never raised into the caller's
request path (a store that is down only costs cache hits).
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Sequence

import grpc
import structlog
import xxhash

from kvmesh.engine.kv.pool_layout import PageSide, copy_ranges
from kvmesh.mesh.grpc_server import channel
from kvmesh.mesh.metrics import KV_FETCH_DIGEST_MISMATCHES as CORRUPT_FETCHES
from kvmesh.mesh.transfer import KvTransferEngine
from kvmesh.proto.v1 import kvstore_pb2, kvstore_pb2_grpc

log = structlog.get_logger(__name__)

# Anything but cancellation: a failing store must never fail the caller's request.
_FAILURES = Exception


def layout_key(model: str, page_size: int, kv_dtype: str, kv_spec: str = "") -> str:
    """The key that keeps pages of incompatible layouts apart: "model|page_size|kv_dtype", then
    the KV spec's own key (kv/layout.py: kinds, heads, dims, page order) when given."""
    base = f"{model}|{page_size}|{kv_dtype}"
    return f"{base}|{kv_spec}" if kv_spec else base


def page_digest_of(side: PageSide, index: int) -> int:
    """xxh3_64 of page `index` of `side`, its shards' bytes in order (the digest of the whole
    page, as the store computes it), without a copy."""
    digest = xxhash.xxh3_64()
    for address, length in side.pieces(index):
        digest.update((ctypes.c_char * length).from_address(address))
    return digest.intdigest()


def _side(local: Sequence[int] | PageSide, page_bytes: int) -> PageSide:
    """Local pages: a PageSide (a sharded pool's) or whole pages at these addresses."""
    return local if isinstance(local, PageSide) else PageSide.whole(local, page_bytes)


class KVStoreClient:
    """One store, reached at `address` (gRPC) and through `transfer` (this process's engine).

    Local pages (whole pages at addresses, or a sharded pool's PageSide: kv/pool_layout.py) must
    lie in memory that stays alive during the call; for RDMA they must be registered with
    `transfer` (TCP does not need it).
    """

    def __init__(self, address: str, transfer: KvTransferEngine, timeout_s: float = 5.0) -> None:
        self.address, self.transfer, self.timeout_s = address, transfer, timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None

    @property
    def stub(self) -> kvstore_pb2_grpc.KVStoreStub:
        """The raw stub (made on first use, inside the running event loop)."""
        if self._stub is None:
            self._channel = channel(self.address)
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def fetch(
        self,
        block_hashes: Sequence[int],
        local: Sequence[int] | PageSide,
        page_bytes: int,
        layout_key: str,
    ) -> int:
        """Copy the store's leading run of `block_hashes` into the local pages; pages fetched."""
        local = _side(local, page_bytes)
        hashes = list(block_hashes[: len(local)])
        if not hashes:
            return 0
        try:
            found = await self.stub.Lookup(
                kvstore_pb2.LookupRequest(
                    block_hashes=hashes, page_bytes=page_bytes, layout_key=layout_key
                ),
                timeout=self.timeout_s,
            )
        except _FAILURES as exc:
            _log_failure("lookup", exc, pages=len(hashes))
            return 0
        if found.hit_pages == 0:
            return 0
        try:
            return await self._read(found, local, page_bytes)
        finally:
            await self._release(found.lease_id)

    async def offer(
        self,
        block_hashes: Sequence[int],
        local: Sequence[int] | PageSide,
        page_bytes: int,
        layout_key: str,
    ) -> int:
        """Store the local pages the store does not hold yet; pages committed."""
        local = _side(local, page_bytes)
        if len(block_hashes) != len(local):
            log.warning("kvstore.offer_bad_args", hashes=len(block_hashes))
            return 0
        if not block_hashes:
            return 0
        try:
            return await self._offer(block_hashes, local, page_bytes, layout_key)
        except _FAILURES as exc:
            _log_failure("offer", exc, pages=len(block_hashes))
            return 0

    async def stats(self) -> kvstore_pb2.GetStatsResponse:
        """The store's GetStats (raises grpc.aio.AioRpcError on failure)."""
        return await self.stub.GetStats(kvstore_pb2.GetStatsRequest(), timeout=self.timeout_s)

    async def _read(
        self, found: kvstore_pb2.LookupResponse, local: PageSide, page_bytes: int
    ) -> int:
        remote = PageSide.whole([loc.address for loc in found.locations], page_bytes)
        local = local.select(range(len(remote)))
        try:
            await asyncio.to_thread(
                self.transfer.read_pages, found.te_session, *copy_ranges(remote, local)
            )
        except _FAILURES as exc:
            _log_failure("fetch_transfer", exc, pages=len(remote))
            return 0  # the local pages may be partly written: the caller must not use them
        return _verified(found.locations, local)

    async def _release(self, lease_id: str) -> None:
        try:
            await self.stub.Release(
                kvstore_pb2.ReleaseRequest(lease_id=lease_id), timeout=self.timeout_s
            )
        except _FAILURES as exc:  # the lease expires on its own
            _log_failure("release", exc)

    async def _offer(
        self, hashes: Sequence[int], local: PageSide, page_bytes: int, layout_key: str
    ) -> int:
        reserved = await self.stub.Reserve(
            kvstore_pb2.ReserveRequest(
                block_hashes=list(hashes), page_bytes=page_bytes, layout_key=layout_key
            ),
            timeout=self.timeout_s,
        )
        if not reserved.reservation_id:
            return 0
        index = {h: i for i, h in enumerate(hashes)}
        src = local.select([index[h] for h in reserved.accepted_hashes])
        dst = PageSide.whole(list(reserved.addresses), page_bytes)
        await asyncio.to_thread(
            self.transfer.write_pages, reserved.te_session, *copy_ranges(src, dst)
        )
        # No commit after a failed write: it may still land, so the reservation must expire.
        digests = [page_digest_of(src, i) for i in range(len(src))]
        done = await self.stub.Commit(
            kvstore_pb2.CommitRequest(reservation_id=reserved.reservation_id, digests=digests),
            timeout=self.timeout_s,
        )
        if done.rejected:
            log.warning("kvstore.offer_rejected", pages=done.rejected)
        return done.committed


def _verified(locations: Sequence[kvstore_pb2.PageLocation], local: PageSide) -> int:
    """Leading pages whose copied bytes hash to the digest the store committed them with."""
    for index, location in enumerate(locations):
        if location.digest and page_digest_of(local, index) != location.digest:
            log.warning("kvstore.fetch_digest_mismatch", page=index, block_hash=location.block_hash)
            CORRUPT_FETCHES.inc()
            return index
    return len(locations)


def _log_failure(what: str, exc: BaseException, **fields: object) -> None:
    if isinstance(exc, grpc.aio.AioRpcError):
        fields.update(status=exc.code().name, error=exc.details())
    else:
        fields.update(error=repr(exc))
    log.warning(f"kvstore.{what}_failed", **fields)
