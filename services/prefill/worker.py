"""Prefill-side logic: compute a prompt's KV (prefix cache first), write the pages into the
decode worker's reserved pages with the transfer engine, return the first token."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import structlog
import torch

from kvmesh.engine.core.engine import TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.pool.integrity import as_int32
from kvmesh.engine.pool.page_io import ImportPlan
from kvmesh.engine.serving.async_engine import AsyncEngine
from kvmesh.errors import DeadlineExceededError, InvalidRequestError, RequestAbortedError
from kvmesh.mesh import metrics, tracing
from kvmesh.mesh.aborted_ids import AbortedIds
from kvmesh.mesh.convert import check_shards
from kvmesh.mesh.page_copies import read_from, write_to
from kvmesh.mesh.store_link import StoreLink
from kvmesh.mesh.transfer import KvTransferEngine, TransferError
from kvmesh.proto.v1 import prefill_pb2

log = structlog.get_logger(__name__)


def read_tags(
    transfer: KvTransferEngine,
    session: str,
    tags_address: int,
    pages: list[int],
    staging: torch.Tensor,
) -> list[int]:
    """A peer's integrity tags of `pages` (int32 bit patterns), read from its tag array at
    `tags_address` into `staging` (registered int32s, at least len(pages))."""
    base = staging.data_ptr()
    transfer.read_pages(
        session, [tags_address + 4 * p for p in pages], [base + 4 * i for i in range(len(pages))], 4
    )
    return staging[: len(pages)].tolist()


@dataclass(frozen=True)
class PrefillResult:
    first: TokenOutput
    bytes_transferred: int
    pages_transferred: int
    draft_window: tuple[torch.Tensor, int] | None = None  # EAGLE: fused rows, first position


class PrefillWorker:
    def __init__(
        self,
        engine: AsyncEngine,
        transfer: KvTransferEngine,
        kv_dtype: str,
        store: StoreLink | None = None,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.kv_dtype = kv_dtype
        self.store = store
        self.pages = engine.kv_pages  # every rank's shard of a page (tensor parallelism)
        self.spec = self.pages.spec  # the whole page's
        self._offers: set[asyncio.Task] = set()
        self.page_io = engine.page_io
        # Source of the tag writes: one registered int32 per page a prompt can have.
        max_pages = -(-engine.max_model_len // self.spec.page_size)
        self._tag_staging = torch.zeros(max_pages, dtype=torch.int32)
        self._tag_lock = threading.Lock()
        transfer.register(self._tag_staging.data_ptr(), max_pages * 4)
        self.faults = engine.faults
        self._aborted = AbortedIds()  # an Abort may come before its prefill reached the engine

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        destination: prefill_pb2.KvDestination,
        cache_salt: str = "",
        resumed: list[int] | None = None,
        deadline: float | None = None,
    ) -> PrefillResult:
        """The KV of `prompt` (then `resumed`: a migrated request's output so far) written into
        `destination`; the result's token is the one after them."""
        self._unless_aborted(request_id)
        resumed = resumed or []
        tokens = [*prompt, *resumed]
        num_pages = -(-len(tokens) // self.spec.page_size)
        self._check(destination, num_pages)
        imported = await self._import_prefix(request_id, tokens, cache_salt, destination)
        self._unless_aborted(request_id)  # (from here on the engine's stream sees an abort)
        # Cancelled inside engine.prefill, the engine drops the request (pages included); from
        # its return on (no await in between) this call releases them.
        first = await self.engine.prefill(request_id, prompt, params, cache_salt, resumed)
        try:
            self._count_hits(len(tokens), first.num_cached_tokens, imported)
            window = await self.engine.hand_over_draft(request_id)
            if first.finish_reason is not None and first.finish_reason.value == "abort":
                raise RequestAbortedError(f"prefill of {request_id} was aborted")
            if deadline is not None and time.monotonic() > deadline:  # no transfer then
                raise DeadlineExceededError(f"prefill of {request_id}: its deadline passed")
            src_pages = (await self.engine.pages_of(request_id))[destination.skip_pages : num_pages]
            dst_pages = list(destination.page_ids)[destination.skip_pages : num_pages]
            with tracing.span("prefill.transfer", pages=len(src_pages)) as moved:
                written = await asyncio.to_thread(self._write, destination, src_pages, dst_pages)
                moved.set_attribute("bytes", written)
        finally:
            await self._release(request_id)
        metrics.KV_TRANSFER_BYTES.labels("prefill").inc(written)
        return PrefillResult(first, written, len(src_pages), window)

    async def abort(self, request_id: str) -> bool:
        """Stop the prefill of `request_id`, and one of that id that has not begun yet; True
        when the engine was running it."""
        self._aborted.add(request_id)
        return await self.engine.abort(request_id)

    def _unless_aborted(self, request_id: str) -> None:
        if request_id in self._aborted:
            raise RequestAbortedError(f"prefill of {request_id} was aborted")

    async def _import_prefix(
        self, request_id: str, prompt: list[int], cache_salt: str, dest: prefill_pb2.KvDestination
    ) -> tuple[int, int]:
        """Local prefix first; then pages the decode worker already holds (read over TE);
        then the KV store; whatever is still missing is computed by the prefill itself.
        Returns the pages imported from (decode, store)."""
        if dest.skip_pages == 0 and self.store is None:
            return 0, 0
        plan = await self.engine.call(self.page_io.plan_import, request_id, prompt, cache_salt)
        if plan is None:
            return 0, 0
        local = plan.page_ids
        from_decode = min(max(dest.skip_pages - plan.start_page, 0), len(local))
        decoded = stored = 0
        try:
            decoded = await self._read_from_decode(plan, local[:from_decode], dest)
            if self.store is not None and decoded == from_decode:
                stored = await self.store.fetch_into(plan.block_hashes[decoded:], local[decoded:])
        finally:
            await self.engine.call(self.page_io.finish_import, request_id, decoded + stored)
        return decoded, stored

    def _count_hits(self, prompt_len: int, cached: int, imported: tuple[int, int]) -> None:
        """Hit tokens per tier; imported pages evicted before use count as misses."""
        page = self.spec.page_size
        from_decode = min(imported[0] * page, cached)
        from_store = min(imported[1] * page, cached - from_decode)
        metrics.PREFIX_LOOKUP_TOKENS.inc(prompt_len)
        metrics.PREFIX_HIT_TOKENS.labels("decode").inc(from_decode)
        metrics.PREFIX_HIT_TOKENS.labels("kvstore").inc(from_store)
        metrics.PREFIX_HIT_TOKENS.labels("prefill_local").inc(cached - from_decode - from_store)

    async def _read_from_decode(
        self, plan: ImportPlan, local: list[int], dest: prefill_pb2.KvDestination
    ) -> int:
        """Read the decode worker's pages into local pages (ids), each layout as it is."""
        if not local:
            return 0
        span = slice(plan.start_page, plan.start_page + len(local))
        held, expected = list(dest.page_ids[span]), list(dest.page_tags[span])

        def read() -> bool:  # (the copy plan off the event loop too)
            read_from(self.transfer, dest, held, self.pages.side(local))
            if dest.tags_address and len(expected) == len(held):  # (else: no tags there)
                with self._tag_lock:  # read after the bytes: a page rewritten meanwhile shows
                    got = read_tags(
                        self.transfer, dest.te_session, dest.tags_address, held, self._tag_staging
                    )
                if got != as_int32(expected).tolist():
                    return False
            self.pages.stage_in(local)
            return True

        try:
            intact = await asyncio.to_thread(read)
        except TransferError as exc:
            log.warning("prefill.read_from_decode_failed", error=str(exc))
            return 0
        if not intact:  # a page of the decode worker's cache changed under us: compute it here
            log.warning("prefill.read_from_decode_rejected", pages=len(held))
            metrics.KV_INTEGRITY_FAILURES.labels("prefill").inc()
            return 0
        metrics.KV_TRANSFER_BYTES.labels("prefill:from_decode").inc(
            len(local) * self.spec.page_bytes
        )
        return len(local)

    async def _release(self, request_id: str) -> None:
        """Free the request's pages; with a store, first offer its new pages (in the background)."""
        if self.store is None:
            await self.engine.release(request_id)
            return
        hashes, pages = await self.engine.computed_pages_of(request_id)
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
        """Page bytes first, then (only if they all landed) the tags decode reserved them with."""
        if not src_pages:
            return 0
        tags = list(dest.page_tags)[dest.skip_pages : dest.skip_pages + len(dst_pages)]
        if self.faults is not None:  # tests only: lose part of the transfer, tags included
            src_pages, dst_pages, tags = self.faults.drop_transfer_pages(src_pages, dst_pages, tags)
        self.pages.stage_out(src_pages)
        written = write_to(self.transfer, self.pages.side(src_pages), dest, dst_pages)
        if dest.tags_address and tags:
            with self._tag_lock:
                self._tag_staging[: len(tags)] = as_int32(tags)
                base = self._tag_staging.data_ptr()
                self.transfer.write_pages(
                    dest.te_session,
                    [base + 4 * i for i in range(len(tags))],
                    [dest.tags_address + 4 * p for p in dst_pages],
                    4,
                )
        return written

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
        if dest.shards:
            try:
                check_shards(dest)
            except ValueError as exc:
                raise InvalidRequestError(f"destination shards: {exc}") from exc
        if dest.page_tags and len(dest.page_tags) != len(dest.page_ids):
            raise InvalidRequestError(
                f"destination has {len(dest.page_ids)} pages but {len(dest.page_tags)} tags"
            )
        if len(dest.page_ids) < num_pages or dest.skip_pages > num_pages:
            raise InvalidRequestError(
                f"destination has {len(dest.page_ids)} pages, the prompt needs {num_pages}"
            )
