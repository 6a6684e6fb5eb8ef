"""KVStore gRPC service: a thin adapter from protos to `KVStore`, and its Prometheus metrics.

Store calls run in a worker thread (they may read or write page files); the store's one lock
keeps its state consistent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.errors import KvmeshError
from kvmesh.mesh.error_mapping import grpc_details, grpc_status
from kvmesh.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.store import KVStore

log = structlog.get_logger(__name__)


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: KVStore) -> None:
        self.store = store

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except KvmeshError as exc:
            log.warning("kvstore.call_failed", call=fn.__name__, code=exc.code, error=str(exc))
            await context.abort(grpc_status(exc), grpc_details(exc))

    async def Lookup(self, request, context) -> kvstore_pb2.LookupResponse:
        found = await self._call(
            context, self.store.lookup, request.block_hashes, request.page_bytes, request.layout_key
        )
        page_bytes = self.store.config.page_bytes
        return kvstore_pb2.LookupResponse(
            hit_pages=len(found.hits),
            locations=[
                kvstore_pb2.PageLocation(
                    block_hash=h.block_hash,
                    tier=h.tier,
                    address=h.address,
                    page_bytes=page_bytes,
                    digest=h.digest,
                )
                for h in found.hits
            ],
            te_session=self.store.te_session,
            lease_id=found.lease_id or "",
            lease_ms=int(self.store.config.lease_s * 1000),
        )

    async def Reserve(self, request, context) -> kvstore_pb2.ReserveResponse:
        reserved = await self._call(
            context,
            self.store.reserve,
            request.block_hashes,
            request.page_bytes,
            request.layout_key,
        )
        return kvstore_pb2.ReserveResponse(
            accepted_hashes=reserved.accepted,
            addresses=reserved.addresses,
            te_session=self.store.te_session,
            reservation_id=reserved.reservation_id or "",
            ttl_ms=int(self.store.config.reservation_s * 1000),
        )

    async def Commit(self, request, context) -> kvstore_pb2.CommitResponse:
        result = await self._call(
            context, self.store.commit, request.reservation_id, list(request.digests)
        )
        return kvstore_pb2.CommitResponse(committed=result.committed, rejected=result.rejected)

    async def Release(self, request, context) -> kvstore_pb2.ReleaseResponse:
        released = await self._call(context, self.store.release, request.lease_id)
        return kvstore_pb2.ReleaseResponse(released=released)

    async def GetStats(self, request, context) -> kvstore_pb2.GetStatsResponse:
        stats = await self._call(context, self.store.stats)
        page_bytes = self.store.config.page_bytes
        return kvstore_pb2.GetStatsResponse(
            tiers=[
                kvstore_pb2.TierStats(
                    tier=t.tier,
                    pages=t.pages,
                    bytes=t.pages * page_bytes,
                    capacity_pages=t.capacity_pages,
                    hits=t.hits,
                    misses=t.misses,
                    evictions=t.evictions,
                )
                for t in stats.tiers
            ],
            promotions=stats.promotions,
            corrupt_pages=stats.corrupt_pages,
            leases=stats.leases,
            reservations=stats.reservations,
            layout_key=self.store.config.layout_key,
            page_bytes=page_bytes,
        )


def add_to(servicer: KVStoreServicer) -> Callable[[grpc.aio.Server], str]:
    def add(server: grpc.aio.Server) -> str:
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server)
        return kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name

    return add


class StoreMetrics(Collector):
    """`kvmesh_kvstore_*` metrics, read from the store's stats at scrape time."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Any]:
        stats = self.store.stats()
        page_bytes = self.store.config.page_bytes
        families = {
            "pages": GaugeMetricFamily("kvmesh_kvstore_pages", "Pages stored", labels=["tier"]),
            "bytes": GaugeMetricFamily("kvmesh_kvstore_bytes", "Bytes stored", labels=["tier"]),
            "capacity": GaugeMetricFamily(
                "kvmesh_kvstore_capacity_pages", "Pages a tier can hold", labels=["tier"]
            ),
            "hits": CounterMetricFamily("kvmesh_kvstore_hits", "Lookup hits", labels=["tier"]),
            "misses": CounterMetricFamily(
                "kvmesh_kvstore_misses", "Lookup misses", labels=["tier"]
            ),
            "evictions": CounterMetricFamily(
                "kvmesh_kvstore_evictions", "Pages evicted out of a tier", labels=["tier"]
            ),
        }
        for t in stats.tiers:
            families["pages"].add_metric([t.tier], t.pages)
            families["bytes"].add_metric([t.tier], t.pages * page_bytes)
            families["capacity"].add_metric([t.tier], t.capacity_pages)
            families["hits"].add_metric([t.tier], t.hits)
            families["misses"].add_metric([t.tier], t.misses)
            families["evictions"].add_metric([t.tier], t.evictions)
        yield from families.values()
        yield CounterMetricFamily(
            "kvmesh_kvstore_promotions", "Disk pages copied back to RAM", value=stats.promotions
        )
        yield CounterMetricFamily(
            "kvmesh_kvstore_corrupt_pages",
            "Disk pages failing their digest",
            value=stats.corrupt_pages,
        )
        yield GaugeMetricFamily("kvmesh_kvstore_leases", "Open lookup leases", value=stats.leases)
        yield GaugeMetricFamily(
            "kvmesh_kvstore_reservations", "Open reservations", value=stats.reservations
        )
