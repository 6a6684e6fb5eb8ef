"""A request whose caller leaves, or that is aborted, while the call adding it to the engine
(generate's add_request, commit's commit_prefilled) waits for or runs on the engine thread: it
must not stay in the batch decoding to max_tokens with nobody reading it (issue 45, item 6: a
client dropped at the hand-over left its request running)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.engine.core.outputs import TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.engine.serving.async_engine import AsyncEngine

KINDS = ["generate", "commit"]


class _StubEngine:
    """The calls that start and end a request, noted in order (`held`: requests it runs); each
    step waits for `go`, so a test can hold the engine thread in one."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.held: set[str] = set()
        self.added = threading.Event()
        self.go, self.busy, self.stepping = threading.Event(), threading.Event(), threading.Event()
        self.go.set()
        self.page_io = None
        self.handover = self  # the hand-over calls are the stub's own

    def has_unfinished(self) -> bool:
        return self.busy.is_set()

    def step(self) -> list[TokenOutput]:
        self.stepping.set()
        self.go.wait(5)
        return []

    def add_request(self, request_id: str, *_) -> None:
        self._add("add", request_id)

    def commit_prefilled(self, request_id: str, first_token: int, *_) -> TokenOutput:
        self._add("commit", request_id)
        return TokenOutput(request_id, [first_token], [None], False, None, 4, 0)

    def _add(self, call: str, request_id: str) -> None:
        self.calls.append(call)
        self.held.add(request_id)
        self.added.set()

    def cancel_reservation(self, request_id: str) -> None:
        self.calls.append("cancel_reservation")

    def abort(self, request_id: str) -> bool:
        self.calls.append("abort")
        return self._end(request_id)

    def drop(self, request_id: str) -> bool:
        self.calls.append("drop")
        return self._end(request_id)

    def _end(self, request_id: str) -> bool:
        held = request_id in self.held
        self.held.discard(request_id)
        return held


class _Engine(AsyncEngine):
    def _measure_load(self):  # the stub has no scheduler or pool
        return None


def _stream(engine: AsyncEngine, kind: str):
    if kind == "generate":
        return engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=2000))
    return engine.commit("r", 7, None, 0)


async def _hold_in_a_step(engine: AsyncEngine, stub: _StubEngine) -> None:
    """The engine thread in a step until `stub.go` is set (a long step)."""
    stub.go.clear()
    stub.busy.set()
    await engine.call(lambda: None)  # wakes the idle step loop
    while not stub.stepping.is_set():
        await asyncio.sleep(0.01)


def _run(stub: _StubEngine, scenario) -> None:
    engine = _Engine(stub)

    async def run() -> None:
        engine.start()
        try:
            await asyncio.wait_for(scenario(engine), 10)
        finally:
            stub.busy.clear()
            stub.go.set()
            engine.stop()

    asyncio.run(run())
    assert not engine._streams


@pytest.mark.parametrize("kind", KINDS)
def test_a_caller_cancelled_after_its_request_was_added_but_before_it_heard_has_it_dropped(kind):
    """The race the mesh hit: the call ran on the engine thread, its answer was on its way to
    the event loop when the caller was cancelled (the gateway cancelled the Generate RPC as
    its client left): the answer is lost, the request in the batch must go."""
    stub = _StubEngine()

    async def scenario(engine: AsyncEngine) -> None:
        task = asyncio.create_task(anext(_stream(engine, kind)))
        await asyncio.sleep(0)  # the task runs up to its call's future: the call is queued
        assert stub.added.wait(5)  # (the loop blocked: the answer cannot reach the task yet)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(stub, scenario)
    assert stub.calls == [kind if kind == "commit" else "add", "drop"]
    assert stub.held == set()


@pytest.mark.parametrize("kind", KINDS)
def test_a_caller_cancelled_while_its_call_waits_for_a_step_never_starts_its_request(kind):
    stub = _StubEngine()

    async def scenario(engine: AsyncEngine) -> None:
        await _hold_in_a_step(engine, stub)
        task = asyncio.create_task(anext(_stream(engine, kind)))
        await asyncio.sleep(0.05)  # its call is queued behind the step
        task.cancel()
        await asyncio.sleep(0.05)
        stub.busy.clear()
        stub.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(stub, scenario)
    assert stub.calls == (["drop"] if kind == "generate" else ["cancel_reservation", "drop"])
    assert stub.held == set()


@pytest.mark.parametrize("kind", KINDS)
def test_an_abort_run_before_the_call_adding_its_request_keeps_the_request_out(kind):
    """The abort reaches the engine first (nothing to stop there yet) and ends the stream; the
    call adding the request, queued behind it, must then not add it."""
    stub = _StubEngine()
    got: list[TokenOutput] = []

    async def scenario(engine: AsyncEngine) -> None:
        await _hold_in_a_step(engine, stub)
        abort = asyncio.create_task(engine.abort("r"))
        await asyncio.sleep(0.05)  # queued first

        async def consume() -> None:
            got.extend([out async for out in _stream(engine, kind)])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # the stream open, its call queued behind the abort
        stub.busy.clear()
        stub.go.set()
        assert await abort is False
        await task

    _run(stub, scenario)
    assert stub.calls == (["abort"] if kind == "generate" else ["abort", "cancel_reservation"])
    assert stub.held == set()
    assert [(o.finished, o.finish_reason) for o in got] == [(True, FinishReason.ABORT)]
