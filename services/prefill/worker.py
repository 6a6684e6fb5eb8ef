"""Prefill-side logic: compute a prompt's KV (prefix cache first), write the pages into the
decode worker's reserved pages with the transfer engine, return the first token."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import TokenOutput
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError
from kvmesh.mesh import metrics
from kvmesh.mesh.store_link import StoreLink
from kvmesh.mesh.transfer import KvTransferEngine
from kvmesh.proto.v1 import prefill_pb2

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    first: TokenOutput
    bytes_transferred: int
    pages_transferred: int


class PrefillWorker:
    def __init__(self, engine: AsyncEngine, transfer: KvTransferEngine, kv_dtype: str,
                 store: StoreLink | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.transfer = transfer
        self.kv_dtype = kv_dtype
        self.store = store
        self.spec = engine.engine.kv_cache.spec
        self._offers: set[asyncio.Task] = set()

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        destination: prefill_pb2.KvDestination,
        cache_salt: str = "",
    ) -> PrefillResult:
        num_pages = -(-len(prompt) // self.spec.page_size)
        self._check(destination, num_pages)
        if self.store is not None:  # local prefix first, then the store, then compute the rest
            await self.store.import_prefix(request_id, prompt, cache_salt)
        first = await self.engine.prefill(request_id, prompt, params, cache_salt)
        try:
            if first.finish_reason is not None and first.finish_reason.value == "abort":
                raise InvalidRequestError(f"prefill of {request_id} was aborted")
            src_pages = self.engine.engine.pages_of(request_id)[destination.skip_pages : num_pages]
            dst_pages = list(destination.page_ids)[destination.skip_pages : num_pages]
            written = await asyncio.to_thread(self._write, destination, src_pages, dst_pages)
        finally:
            await self._release(request_id)
        metrics.KV_TRANSFER_BYTES.labels("prefill").inc(written)
        return PrefillResult(first, written, len(src_pages))

    async def _release(self, request_id: str) -> None:
        """Free the request's pages; with a store, first offer its new pages (in the background)."""
        if self.store is None:
            await self.engine.release(request_id)
            return
        hashes, pages = self.engine.engine.computed_pages_of(request_id)
        task = asyncio.create_task(self._offer_then_release(request_id, hashes, pages))
        self._offers.add(task)
        task.add_done_callback(self._offers.discard)

    async def _offer_then_release(
        self, request_id: str, hashes: list[int], pages: list[int]
    ) -> None:
        try:
            await self.store.offer_pages(hashes, pages)
        finally:
            await self.engine.release(request_id)

    def _write(
        self, dest: prefill_pb2.KvDestination, src_pages: list[int], dst_pages: list[int]
    ) -> int:
        if not src_pages:
            return 0
        cache = self.engine.engine.kv_cache
        src = [cache.page_address(p) for p in src_pages]
        dst = [dest.pool_address + p * dest.page_bytes for p in dst_pages]
        return self.transfer.write_pages(dest.te_session, src, dst, self.spec.page_bytes)

    def _check(self, dest: prefill_pb2.KvDestination, num_pages: int) -> None:
        if dest.page_bytes != self.spec.page_bytes or dest.page_size != self.spec.page_size:
            raise InvalidRequestError(
                f"incompatible KV pages: decode has {dest.page_bytes} B x {dest.page_size} tokens, "
                f"prefill {self.spec.page_bytes} B x {self.spec.page_size}"
            )
        if dest.kv_dtype != self.kv_dtype:
            raise InvalidRequestError(
                f"KV dtype mismatch: decode {dest.kv_dtype}, prefill {self.kv_dtype}"
            )
        if len(dest.page_ids) < num_pages or dest.skip_pages > num_pages:
            raise InvalidRequestError(
                f"destination has {len(dest.page_ids)} pages, the prompt needs {num_pages}"
            )
