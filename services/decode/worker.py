"""Decode-side logic: reserve pages, have a prefill worker fill them, then decode in the batch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from kvmesh.engine.core.engine import Reservation, TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.engine.serving.async_engine import AsyncEngine
from kvmesh.engine.serving.output_streams import Tap
from kvmesh.errors import (
    DeadlineExceededError,
    OverloadedError,
    PrefillOverloadedError,
    PrefillUnavailable,
)
from kvmesh.mesh import convert, tracing
from kvmesh.mesh.aborted_ids import AbortedIds
from kvmesh.mesh.error_mapping import error_from_grpc
from kvmesh.mesh.grpc_server import channel
from kvmesh.proto.v1 import decode_pb2, prefill_pb2, prefill_pb2_grpc

log = structlog.get_logger(__name__)
RESERVE_TIMEOUT_S = 30.0
RESERVE_POLL_S = 0.05  # retry a reservation this often while pages are short
PREFILL_TIMEOUT_S = 120.0
LATE_WRITE_S = 10.0  # a timed-out prefill's pages stay out of use this long (see below)


_PREFILL_GONE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
)


@dataclass(frozen=True)
class DecodeJob:
    """One Decode.Generate request in domain terms."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    prefill_address: str = ""  # empty: prefill here
    cache_salt: str = ""
    resumed: tuple[int, ...] = ()  # a migrated request: output the client already has
    deadline: float | None = None  # time.monotonic() by which it must end (the call's deadline)
    span: Any = None  # its trace span here (mesh/tracing.py): the prefill call's parent

    def time_left(self, bound_s: float) -> float:
        """Seconds a wait of this job may take: `bound_s`, or less when its deadline is closer;
        DeadlineExceededError once the deadline passed."""
        if self.deadline is None:
            return bound_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"request {self.request_id}: its deadline passed")
        return min(bound_s, left)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.resumed)


class DecodeWorker:
    def __init__(
        self,
        engine: AsyncEngine,
        te_session: str,
        kv_dtype: str,
        local_prefill_tokens: int = 0,
    ) -> None:
        self.engine = engine
        self.te_session = te_session
        self.kv_dtype = kv_dtype
        self.local_prefill_tokens = local_prefill_tokens  # prompts this short are prefilled here
        self._stubs: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._aborts: dict[str, asyncio.Event] = {}  # requests the engine may not hold yet
        self._aborted_early = AbortedIds()  # aborted before their Generate came: refused then
        self._late: set[asyncio.Task] = set()

    async def generate(self, job: DecodeJob, tap: Tap | None = None) -> AsyncIterator[TokenOutput]:
        """Stream the job's outputs (those `tap` does not take: output_streams.py); `abort`
        ends it at any stage (reserving pages, waiting for the prefill worker, decoding) with
        finish reason abort, even when it came before the job."""
        if job.request_id in self._aborted_early:  # its Abort overtook it
            yield _aborted(job)
            return
        aborted = self._aborts[job.request_id] = asyncio.Event()
        if tap is not None:  # an abort that came before the engine had the request: below
            tap = _UnlessAborted(tap, aborted)
        try:
            stream = await self._start(job, aborted, tap)
            if stream is None:
                yield _aborted(job)
                return
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if aborted.is_set():  # an abort that came before the engine had the request
                        await self.engine.abort(job.request_id)
                    self._aborts.pop(job.request_id, None)
                    yield out
        finally:
            self._aborts.pop(job.request_id, None)

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is; False if this worker does not know it (yet: a
        Generate of that id that comes later ends at once)."""
        event = self._aborts.get(request_id)
        if event is not None:
            event.set()
        else:  # noted before any await: a Generate starting meanwhile sees it
            self._aborted_early.add(request_id)
        return await self.engine.abort(request_id) or event is not None

    async def _start(
        self, job: DecodeJob, aborted: asyncio.Event, tap: Tap | None
    ) -> AsyncIterator[TokenOutput] | None:
        """The engine's output stream for the job, or None when it was aborted before."""
        if not job.prefill_address or job.num_tokens <= self.local_prefill_tokens:
            return self.engine.generate(
                job.request_id,
                job.prompt,
                job.params,
                cache_salt=job.cache_salt,
                tap=tap,
                resumed=job.resumed,
            )
        try:
            reservation = await self._reserve(job, aborted)
            if reservation is None:
                return None
            pages, cached = self.engine.kv_pages, reservation.cached_pages
            if pages.staged:  # the prefill worker reads our cached prefix pages
                await asyncio.to_thread(pages.stage_out, reservation.page_ids[:cached])
            response = await self._remote_prefill(job, reservation, aborted)
            if response is not None and pages.staged:  # what it wrote: mirror -> pool
                await asyncio.to_thread(pages.stage_in, reservation.page_ids[cached:])
            if response is not None and aborted.is_set():  # while the prefill call returned
                await self.engine.cancel_reservation(job.request_id)
                return None
        except BaseException:
            # whatever ended it (a deadline, a cancel while a reserve was queued, a failed
            # call), no reservation outlives it; idempotent, and queued after a late reserve
            await asyncio.shield(self.engine.cancel_reservation(job.request_id))
            raise
        if response is None:
            return None
        first_lp = None
        if response.HasField("first_logprob"):
            first_lp = convert.logprob_from_pb(response.first_logprob)
        cached = response.cached_tokens  # what prefill did not compute (it reads our prefix pages)
        window = None
        if response.HasField("draft_window") and response.draft_window.rows:
            rows = response.draft_window
            window = (convert.feature_rows_from_pb(rows), rows.start_position)
        return self.engine.commit(
            job.request_id, response.first_token_id, first_lp, cached, window, tap
        )

    async def _reserve(self, job: DecodeJob, aborted: asyncio.Event) -> Reservation | None:
        deadline = time.monotonic() + job.time_left(RESERVE_TIMEOUT_S)
        while not aborted.is_set():
            reservation = await self.engine.reserve(
                job.request_id, job.prompt, job.params, job.cache_salt, job.resumed
            )
            if reservation is not None:
                return reservation
            if time.monotonic() > deadline:
                job.time_left(0.0)  # the request's own deadline, if that is what passed
                raise OverloadedError(
                    f"no free KV pages for {job.num_tokens} prompt tokens within "
                    f"{RESERVE_TIMEOUT_S}s"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(aborted.wait(), RESERVE_POLL_S)
        return None

    async def _remote_prefill(
        self, job: DecodeJob, reservation: Reservation, aborted: asyncio.Event
    ) -> prefill_pb2.PrefillResponse | None:
        """Pages are freed only after the Prefill call ended: no transfer can land afterwards.
        None: aborted while the prefill worker was at it (told to abort, pages freed)."""
        address = job.prefill_address
        request = self._prefill_request(job, reservation)
        timeout = job.time_left(PREFILL_TIMEOUT_S)  # past the deadline: no call (pages freed)
        span = tracing.start_span("decode.prefill_call", job.span, prefill=address)
        call = asyncio.ensure_future(
            self._stub(address).Prefill(
                request, timeout=timeout, metadata=tracing.outgoing_metadata(span)
            )
        )
        call.add_done_callback(lambda _: span.end())
        abort_wait = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait({call, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                await self._abort_prefill(address, job.request_id, call)
                return None
            return call.result()
        except asyncio.CancelledError:
            await self._abort_prefill(address, job.request_id, call)
            raise
        except grpc.aio.AioRpcError as exc:
            await self._free_after_failed_prefill(job.request_id, exc.code())
            log.warning("decode.prefill_failed", prefill=address, code=exc.code().name)
            failed = error_from_grpc(exc.code(), f"prefill worker {address}: {exc.details()}")
            if isinstance(failed, OverloadedError):
                raise PrefillOverloadedError(str(failed)) from exc
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                job.time_left(0.0)  # the request's deadline passed: not the prefill worker's fault
            if exc.code() in _PREFILL_GONE:
                raise PrefillUnavailable(f"prefill worker {address}: {exc.details()}") from exc
            raise failed from exc
        finally:
            abort_wait.cancel()

    async def _free_after_failed_prefill(self, request_id: str, code: grpc.StatusCode) -> None:
        """Free the reserved pages of a Prefill call that failed. A call that timed out or was
        cancelled on our side may still be writing into them on the prefill worker: those pages
        stay out of use (the reservation held) for LATE_WRITE_S first, so no late byte lands in
        another request's page."""
        if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            await self.engine.cancel_reservation(request_id)
            return
        # shielded: a cancel while it is queued must not lose the ticket (the pages with it)
        await asyncio.shield(self._quarantine(request_id))

    async def _quarantine(self, request_id: str) -> None:
        ticket = await self.engine.quarantine(request_id)  # the request id is free again

        def release() -> None:
            task = asyncio.ensure_future(self.engine.end_quarantine(ticket))
            self._late.add(task)
            task.add_done_callback(self._late.discard)

        asyncio.get_running_loop().call_later(LATE_WRITE_S, release)

    async def _abort_prefill(self, address: str, request_id: str, call: asyncio.Future) -> None:
        """Tell the prefill worker to stop, wait until its call ended, then free the pages."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub(address).Abort(
                decode_pb2.AbortRequest(request_id=request_id), timeout=5
            )
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(call), timeout=PREFILL_TIMEOUT_S)
        await self.engine.cancel_reservation(request_id)

    def _prefill_request(
        self, job: DecodeJob, reservation: Reservation
    ) -> prefill_pb2.PrefillRequest:
        cache, pages = self.engine.kv_cache, self.engine.kv_pages
        spec = pages.spec  # the whole page's (a sharded pool: each rank holds some heads)
        destination = prefill_pb2.KvDestination(
            te_session=self.te_session,
            pool_address=pages.layout.shards[0].address,
            page_bytes=spec.page_bytes,
            page_ids=reservation.page_ids,
            skip_pages=reservation.cached_pages,
            page_size=spec.page_size,
            kv_dtype=self.kv_dtype,
            tags_address=cache.tag_address(0),
            page_tags=reservation.page_tags,
            shards=convert.shards_to_pb(pages.layout) if pages.sharded else (),
        )
        return prefill_pb2.PrefillRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt,
            sampling=convert.sampling_to_pb(job.params),
            destination=destination,
            cache_salt=job.cache_salt,
            resume_token_ids=job.resumed,
        )

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._stubs:
            self._stubs[address] = prefill_pb2_grpc.PrefillStub(channel(address))
        return self._stubs[address]


def _aborted(job: DecodeJob) -> TokenOutput:
    return TokenOutput(job.request_id, [], [], True, FinishReason.ABORT, len(job.prompt), 0)


class _UnlessAborted:
    """A tap that declines once the request was aborted, so its outputs reach `generate`'s loop
    (which aborts it in the engine: the abort may have come before the engine had it)."""

    def __init__(self, tap: Tap, aborted: asyncio.Event) -> None:
        self._tap = tap
        self._aborted = aborted

    def take(self, out: TokenOutput) -> bool:
        return not self._aborted.is_set() and self._tap.take(out)

    def flush(self) -> None:
        self._tap.flush()
