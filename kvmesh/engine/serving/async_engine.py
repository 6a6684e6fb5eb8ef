"""The engine in a worker process: one thread runs `Engine.step`; asyncio callers stream outputs.

Every engine call runs on that thread, between steps and under one lock (`call`), so the step
loop and RPC handlers never touch the scheduler or the page pool at the same time, and no
other thread of the worker runs torch (engine_thread.py: why that matters on CPU, and how the
engine is built). The engine itself is private: callers get its immutable parts (the KV pool's
layout and addresses, limits) as properties and everything else through `call`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import structlog

from kvmesh.engine.core.engine import Engine, Reservation, TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.engine.kv.events import KvEvent
from kvmesh.engine.pool.kv_cache import PagedKVCache
from kvmesh.engine.pool.kv_pages import KvPages
from kvmesh.engine.runner.sampler import TokenLogprob
from kvmesh.engine.serving.engine_load import EngineLoad, measure_load
from kvmesh.engine.serving.engine_thread import Call
from kvmesh.engine.serving.output_streams import OutputStream, Tap, flush_all, put_all
from kvmesh.errors import EngineFailure

log = structlog.get_logger(__name__)
# An idle engine thread sleeps until a call wakes it (every call sets the event after queueing
# itself); the timeout is only a backstop. At 50 ms, idle prefill and decode workers woke 20
# times a second each, for CPU taken from the decode steps they share cores with (measured:
# docs/benchmarks-history.md, "Delivery on a plain socket, an fp32 GEMV, and each single-stream
# request against its own ceiling").
_IDLE_WAIT_S = 1.0


class AsyncEngine:
    def __init__(self, engine: Engine, on_thread_start: Callable[[], None] | None = None) -> None:
        self._engine = engine
        self._on_thread_start = on_thread_start  # first on the engine thread (e.g. its CPU)
        self.page_io = engine.page_io  # its methods run under the lock: pass them to `call`
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._calls: deque[Call] = deque()  # run on the engine thread between steps
        self._calls_lock = threading.Lock()  # guards _calls against the thread's end
        self._closed = True  # no step loop to run calls: they run on a pool thread
        self._streams: dict[str, OutputStream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._load = self._measure_load()  # published under the lock, read without it

    def start(self) -> None:
        self._closed = False
        try:
            self._thread.start()
        except BaseException:
            self._closed = True
            raise

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the step loop (engine thread) ------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._on_thread_start is not None:
                self._on_thread_start()
            while not self._stopped:
                self._run_calls()
                with self._lock:
                    busy = self._engine.has_unfinished()
                    outputs = self._step() if busy else []
                    self._load = self._measure_load()
                if not busy and not self._calls:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                self._deliver_step(outputs)
        finally:
            with self._calls_lock:
                self._closed = True
            while self._calls:  # what was asked before the loop ended still runs
                self._run_calls()

    def _run_calls(self) -> None:
        """The calls queued when it starts, each in its caller's context (log bindings); later
        ones wait for the next turn, so a stream of calls cannot starve the steps."""
        for _ in range(len(self._calls)):
            call = self._calls.popleft()
            try:
                answer = call.context.run(self._locked, call.fn, call.args)
            except BaseException as exc:  # the load snapshot failed: the caller hears of it
                answer = (None, exc)
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: no one waits
                call.loop.call_soon_threadsafe(call.settle, *answer)

    def _locked(self, fn: Callable[..., Any], args: tuple) -> tuple[Any, BaseException | None]:
        """fn(*args) under the lock: (result, None) or (None, the exception it raised)."""
        with self._lock:
            try:
                return fn(*args), None
            except BaseException as exc:  # handed to the caller's coroutine
                return None, exc
            finally:
                self._load = self._measure_load()

    def _deliver_step(self, outputs: list[TokenOutput]) -> None:
        """A step's outputs: to their requests' taps here, the rest with one wake-up per event
        loop (not one per request: each call_soon_threadsafe writes the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, TokenOutput]]] = {}
        taps = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            tap = stream.offer(out)
            if tap is not None:
                taps.append(tap)
            else:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        flush_all(taps)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(put_all, items)

    def _step(self) -> list[TokenOutput]:
        try:
            return self._engine.step()
        except (
            Exception
        ) as exc:  # a bug or OOM in a step fails the requests in flight, not the worker
            log.exception("engine.step_failed")
            for request_id in list(self._streams):
                self._engine.abort(request_id)
                self._deliver(request_id, EngineFailure(f"engine step failed: {exc}"))
            return []

    def _deliver(self, request_id: str, item: Any) -> None:
        """Engine thread: one output (or an error) of a request outside a step's batch."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        tap = stream.offer(item)
        if tap is not None:
            flush_all([tap])
        else:
            stream.loop.call_soon_threadsafe(stream.put, item)

    # -- calls from asyncio -----------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run an engine method on the engine thread, before its next step, under the lock
        (on a pool thread when no step loop runs: before `start`, after `stop`)."""
        loop = asyncio.get_running_loop()
        call = Call(fn, args, loop, loop.create_future(), contextvars.copy_context())
        with self._calls_lock:
            closed = self._closed
            if not closed:
                self._calls.append(call)
        if closed:
            result, error = await asyncio.to_thread(self._locked, fn, args)
        else:
            self._wake.set()
            result, error = await call.future
        self._wake.set()
        if error is not None:
            raise error
        return result

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        keep_pages: bool = False,
        cache_salt: str = "",
        tap: Tap | None = None,
        resumed: Sequence[int] = (),
    ) -> AsyncIterator[TokenOutput]:
        """Run a request here (prefill and decode) and stream its outputs (those `tap` does
        not take: output_streams.py); `resumed`: output another worker already sent."""
        stream = self._open(request_id, tap)

        def add() -> None:  # not once aborted: an abort that came first found nothing to stop
            if not stream.aborted:
                self._engine.add_request(
                    request_id, prompt, params, keep_pages, cache_salt, resumed
                )

        try:
            await self._prepare(params)
            await self.call(add)
        except BaseException as exc:
            await self._forget(request_id, stream, exc)
            raise
        async with contextlib.aclosing(self._drain(request_id, stream)) as drain:
            async for out in drain:
                yield out

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        resumed: Sequence[int] = (),
    ) -> TokenOutput:
        """Compute the KV of the prompt (and `resumed`) and the next token; the pages stay held
        until `release`."""
        last = None
        one = replace(params, max_tokens=len(resumed) + 1)
        async for out in self.generate(request_id, prompt, one, True, cache_salt, None, resumed):
            last = out
        assert last is not None and last.finished
        return last

    async def reserve(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        resumed: Sequence[int] = (),
    ) -> Reservation | None:
        await self._prepare(params)
        return await self.call(
            self._engine.handover.reserve, request_id, prompt, params, cache_salt, resumed
        )

    async def _prepare(self, params: SamplingParams) -> None:
        """Compile the request's grammar here, off the engine thread (the engine then copies
        the compiled matcher under its lock)."""
        if params.grammar is not None:
            await asyncio.to_thread(self._engine.constraints.prepare, params.grammar)

    async def commit(
        self,
        request_id: str,
        first_token: int,
        logprob: TokenLogprob | None,
        cached_tokens: int,
        draft_window: tuple[Any, int] | None = None,
        tap: Tap | None = None,
    ) -> AsyncIterator[TokenOutput]:
        """Join the batch after a prefill worker filled the reserved pages; stream outputs
        (those `tap` does not take)."""
        stream = self._open(request_id, tap)

        def commit_and_deliver() -> None:
            if stream.aborted:  # before it joined the batch: its pages go back instead
                self._engine.handover.cancel_reservation(request_id)
                return
            # the first output goes out from the engine thread, like every later one: the loop
            # then gets it before the next step's (a put after the call returned could land
            # behind them when the loop lags)
            first = self._engine.handover.commit_prefilled(
                request_id, first_token, logprob, cached_tokens, draft_window
            )
            self._deliver(request_id, first)

        try:
            await self.call(commit_and_deliver)
        except BaseException as exc:
            await self._forget(request_id, stream, exc)
            raise
        async with contextlib.aclosing(self._drain(request_id, stream)) as drain:
            async for out in drain:
                yield out

    async def _drain(self, request_id: str, stream: OutputStream) -> AsyncIterator[TokenOutput]:
        try:
            async for out in stream.drain():
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not stream.ended:  # the consumer went away: its pages, kept ones too, are freed
                await self.call(self._engine.drop, request_id)

    def _open(self, request_id: str, tap: Tap | None) -> OutputStream:
        stream = self._streams[request_id] = OutputStream(asyncio.get_running_loop(), tap)
        return stream

    async def _forget(self, request_id: str, stream: OutputStream, error: BaseException) -> None:
        """The call that adds a request (generate, commit) did not answer. Cancelled -- its
        caller left, e.g. a cancelled RPC -- the call still runs on the engine thread, maybe
        already ran (its answer lost): it is told not to add the request, and a drop queued
        behind it (calls run in order) ends the request if it was too late for that."""
        self._streams.pop(request_id, None)
        if isinstance(error, asyncio.CancelledError):
            stream.aborted = True
            await asyncio.shield(self.call(self._engine.drop, request_id))

    async def abort(self, request_id: str) -> bool:
        def abort_and_tell() -> bool:
            # told from the engine thread: a caller cancelled while it waited for the lock (an
            # Abort RPC past its deadline during a long step) must not leave the stream waiting
            aborted = self._engine.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:  # its request, if not added yet, never will be
                stream.aborted = True
            self._deliver(
                request_id, TokenOutput(request_id, [], [], True, FinishReason.ABORT, 0, 0)
            )
            return aborted

        return await self.call(abort_and_tell)

    async def release(self, request_id: str) -> None:
        await self.call(self._engine.handover.release, request_id)

    async def cancel_reservation(self, request_id: str) -> None:
        await self.call(self._engine.handover.cancel_reservation, request_id)

    async def quarantine(self, request_id: str) -> str:
        """Hold a reservation's pages while a late write may land (handover.py); the ticket
        goes to `end_quarantine`."""
        return await self.call(self._engine.handover.quarantine, request_id)

    async def end_quarantine(self, ticket: str) -> None:
        await self.call(self._engine.handover.end_quarantine, ticket)

    def kv_events(self) -> AsyncIterator[tuple[bool, list[KvEvent]]]:
        """(is_snapshot, events): first the whole prefix cache as one PagesStored, then changes."""
        return self._engine.kv_events.follow(self.call, self._engine.block_manager.cached_hashes)

    async def lost(self, every_s: float = 0.25) -> None:
        """Return once the engine can serve no more (a tensor-parallel rank died); never for
        an engine of one rank. Polled: a rank may die while no step runs."""
        while self._engine.serviceable():
            await asyncio.sleep(every_s)
        await asyncio.to_thread(self._engine.close)  # the other ranks now: a pass waiting on
        # them fails at once (rather than when the worker stops its engine thread)

    # -- the engine's immutable parts -----------------------------------------------------------
    @property
    def kv_cache(self) -> PagedKVCache:
        """The page pool: its spec and addresses never change (its bytes do, under the lock)."""
        return self._engine.kv_cache

    @property
    def kv_pages(self) -> KvPages:
        """The whole pool as transfers see it: every tensor-parallel rank's shard of a page."""
        return self._engine.kv_pages

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def kv_dtype(self) -> str:
        return self._engine.kv_dtype

    @property
    def faults(self) -> Any:
        """The fault injector (tests), or None."""
        return self._engine.faults

    # -- reads of mutable state, under the lock --------------------------------------------------
    async def pages_of(self, request_id: str) -> list[int]:
        return await self.call(self._engine.handover.pages_of, request_id)

    async def computed_pages_of(self, request_id: str) -> tuple[list[int], list[int]]:
        return await self.call(self._engine.handover.computed_pages_of, request_id)

    async def hand_over_draft(self, request_id: str) -> tuple[Any, int] | None:
        """EAGLE: the draft window a prefill hands to decode (None without a speculator)."""
        speculator = self._engine.speculator
        if speculator is None:
            return None
        return await self.call(speculator.hand_over, request_id)

    @property
    def num_used_pages(self) -> int:
        return self._load.kv_pages_used

    def load(self) -> EngineLoad:
        """The load after the last step or call: a snapshot the engine thread publishes, so
        reading it never waits for a step (a long prefill step would stall load polls)."""
        return self._load

    def _measure_load(self) -> EngineLoad:  # under the lock (or before the thread starts)
        return measure_load(self._engine)
