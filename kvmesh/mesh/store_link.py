"""A worker's link to the KV store: finds the store in etcd, pulls a prompt's missing prefix
pages into the local pool before prefill, and pushes pages out (prefill: new prompt pages;
decode: a finished sequence's pages) without ever blocking a request on the store."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import structlog

from kvmesh.engine.pool.page_io import ExportedPages
from kvmesh.engine.serving.async_engine import AsyncEngine
from kvmesh.mesh import metrics
from kvmesh.mesh.discovery import Registry
from kvmesh.mesh.kvstore_client import KVStoreClient, layout_key
from kvmesh.mesh.transfer import KvTransferEngine

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StoreLinkOptions:
    etcd: str
    cluster: str = "default"
    refresh_s: float = 2.0


class StoreLink:
    def __init__(
        self,
        options: StoreLinkOptions,
        engine: AsyncEngine,
        transfer: KvTransferEngine,
        service: str,
    ) -> None:
        self.options = options
        self.engine = engine
        self.transfer = transfer
        self.service = service
        self.page_io = engine.page_io
        self.pages = engine.kv_pages  # every rank's shard of a page
        spec = self.pages.spec
        self.page_bytes = spec.page_bytes
        self.layout_key = layout_key(
            engine.model_name, spec.page_size, engine.kv_dtype, spec.layout_key
        )
        self._client: KVStoreClient | None = None
        self._address = ""
        self._pending: set[asyncio.Task] = set()
        self._offers = metrics.KV_STORE_OFFERS_IN_FLIGHT.labels(service)

    async def run(self) -> None:
        """Follow the store's registration (it may come, go or move); an etcd that is not
        there yet only delays it (the registry connects, and logs in, on the first read)."""
        registry = Registry(self.options.etcd, self.options.cluster)
        try:
            while True:
                with contextlib.suppress(Exception):
                    stores = await registry.list_workers("kvstore")
                    self._use(stores[0].grpc_address if stores else "")
                await asyncio.sleep(self.options.refresh_s)
        finally:
            await registry.close()

    def _use(self, address: str) -> None:
        if address != self._address:
            log.info("kvstore.link", address=address or None)
            self._address = address
            self._client = KVStoreClient(address, self.transfer) if address else None

    async def fetch_into(self, block_hashes: list[int], page_ids: list[int]) -> int:
        """Fill local pages with the store's copies of the leading hashes; pages fetched."""
        client = self._client
        if client is None or not block_hashes:
            return 0
        local = self.pages.side(page_ids)
        fetched = await client.fetch(block_hashes, local, self.page_bytes, self.layout_key)
        if self.pages.staged:
            await asyncio.to_thread(self.pages.stage_in, page_ids[:fetched])
        return fetched

    def enable_export(self) -> None:
        """Decode: every finished sequence's full pages are offered to the store."""
        loop = asyncio.get_running_loop()

        def sink(pages: ExportedPages) -> None:  # engine thread
            if self._client is not None:
                self._offers.inc()  # from the moment the pages exist, until the store answered
                loop.call_soon_threadsafe(self._spawn_offer, pages)

        self.page_io.export_on_finish(sink)

    def _spawn_offer(self, pages: ExportedPages) -> None:
        task = asyncio.create_task(self._offer_staged(pages))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _offer_staged(self, pages: ExportedPages) -> None:
        try:
            client = self._client
            if client is None:
                return
            base = pages.staging.data_ptr()
            addresses = [base + i * self.page_bytes for i in range(len(pages.block_hashes))]
            await client.offer(pages.block_hashes, addresses, self.page_bytes, self.layout_key)
        finally:
            self._offers.dec()

    async def offer_pages(self, block_hashes: list[int], page_ids: list[int]) -> None:
        """Prefill: offer pages still held by a request (the caller releases them afterwards)."""
        client = self._client
        if client is None or not block_hashes:
            return
        local = self.pages.side(page_ids)
        self._offers.inc()
        try:
            if self.pages.staged:
                await asyncio.to_thread(self.pages.stage_out, page_ids)
            await client.offer(block_hashes, local, self.page_bytes, self.layout_key)
        finally:
            self._offers.dec()
