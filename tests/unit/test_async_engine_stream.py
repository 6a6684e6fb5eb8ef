"""A request's output stream out of the engine thread: what piled up while its consumer was busy
comes out as one output (fewer gRPC messages), errors and the finish never merged away."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.engine.core.outputs import TokenLogprob, TokenOutput
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.engine.serving.async_engine import AsyncEngine
from kvmesh.engine.serving.output_streams import OutputStream, put_all
from kvmesh.errors import EngineFailure


def _out(token: int, finished: bool = False) -> TokenOutput:
    logprob = TokenLogprob(token, -0.5, 1, ())
    reason = FinishReason.LENGTH if finished else None
    return TokenOutput("r", [token], [logprob], finished, reason, 7, 3)


def _drained(items: list, tap=None) -> tuple[list[TokenOutput], BaseException | None]:
    """What a stream's consumer gets of `items` the engine thread handed out while it was busy
    (as AsyncEngine._deliver_step does: offered to the tap, the rest put on the loop)."""

    async def run():
        stream = OutputStream(asyncio.get_running_loop(), tap)
        untaken = [(stream, item) for item in items if stream.offer(item) is None]
        put_all(untaken)
        got: list[TokenOutput] = []
        try:
            async for out in stream.drain():
                got.append(out)
        except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
            return got, exc
        return got, None

    return asyncio.run(run())


class _Tap:
    def __init__(self, decline_at: int | None = None, raises: bool = False) -> None:
        self.asked: list[int] = []
        self.decline_at, self.raises = decline_at, raises

    def take(self, out: TokenOutput) -> bool:
        self.asked.append(out.new_token_ids[0])
        if out.new_token_ids[0] == self.decline_at:
            if self.raises:
                raise RuntimeError("the delivery stream broke")
            return False
        return True

    def flush(self) -> None:
        pass


def test_outputs_that_piled_up_come_out_as_one_with_the_last_ones_state():
    got, error = _drained([_out(1), _out(2), _out(3), _out(4, finished=True)])
    assert error is None and len(got) == 1
    assert got[0].new_token_ids == [1, 2, 3, 4]
    assert [lp.token_id for lp in got[0].new_logprobs] == [1, 2, 3, 4]
    assert got[0].finished and got[0].finish_reason is FinishReason.LENGTH
    assert (got[0].num_prompt_tokens, got[0].num_cached_tokens) == (7, 3)


def test_an_error_after_tokens_is_raised_after_they_are_delivered():
    got, error = _drained([_out(1), _out(2), EngineFailure("step failed")])
    assert [o.new_token_ids for o in got] == [[1, 2]]
    assert isinstance(error, EngineFailure)


@pytest.mark.parametrize("first_finished", [True, False])
def test_nothing_follows_a_finished_output(first_finished):
    items = [_out(1, finished=True), _out(2)] if first_finished else [_out(1), _out(2, True)]
    got, error = _drained(items)
    assert error is None
    assert [o.new_token_ids for o in got] == ([[1]] if first_finished else [[1, 2]])


def test_a_tap_takes_the_outputs_before_the_last_and_never_an_error():
    tap = _Tap()
    got, error = _drained([_out(1), _out(2), _out(3, finished=True)], tap)
    assert tap.asked == [1, 2] and error is None
    assert [o.new_token_ids for o in got] == [[3]] and got[0].finished
    tap = _Tap()
    got, error = _drained([_out(1), EngineFailure("step failed")], tap)
    assert tap.asked == [1] and got == [] and isinstance(error, EngineFailure)


@pytest.mark.parametrize("raises", [False, True])
def test_once_a_tap_declines_that_output_and_every_later_one_come_in_order(raises):
    tap = _Tap(decline_at=2, raises=raises)
    got, error = _drained([_out(1), _out(2), _out(3), _out(4, finished=True)], tap)
    assert error is None and tap.asked == [1, 2]  # never asked again after declining
    assert [o.new_token_ids for o in got] == [[2, 3, 4]] and got[0].finished


class _StubEngine:
    """What the step loop asks of an engine: one request pending until `busy` is cleared; each
    step waits for `go` (a step as long as the test wants) and notes the thread it ran on."""

    def __init__(self) -> None:
        self.busy, self.go = threading.Event(), threading.Event()
        self.go.set()
        self.threads: dict[str, set[str]] = {"step": set(), "call": set()}  # thread names
        self.aborted: list[str] = []
        self.page_io = None
        self.handover = self  # the hand-over calls are the stub's own

    def has_unfinished(self) -> bool:
        return self.busy.is_set()

    def step(self) -> list[TokenOutput]:
        self.threads["step"].add(threading.current_thread().name)
        self.go.wait(5)
        outputs, self.next_outputs = self.next_outputs, []
        return outputs

    next_outputs: list[TokenOutput] = []  # what the next step emits

    def commit_prefilled(self, request_id: str, first_token: int, *_) -> TokenOutput:
        """The prefill worker's first token; the step right after emits the second."""
        self.next_outputs = [_out(2, finished=True)]
        self.busy.set()
        return _out(first_token)

    def abort(self, request_id: str) -> bool:
        self.threads["call"].add(threading.current_thread().name)
        self.aborted.append(request_id)
        return True


class _Engine(AsyncEngine):
    def _measure_load(self):  # the stub has no scheduler or pool
        return None


def test_calls_run_on_the_engine_thread_between_steps_and_on_a_pool_thread_once_it_stops():
    """Every engine call runs on the step loop's thread (one thread of the worker runs torch:
    see AsyncEngine), its exception raised in the caller; after `stop`, on a pool thread."""
    stub = _StubEngine()
    engine = _Engine(stub)

    async def run() -> None:
        engine.start()
        stub.busy.set()
        assert await engine.call(stub.abort, "a") is True
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda: 1 / 0)
        stub.busy.clear()
        assert await engine.call(stub.abort, "b") is True  # the loop idle: woken to run it
        assert stub.threads == {"step": {"engine-step"}, "call": {"engine-step"}}
        engine.stop()
        assert not engine._thread.is_alive()
        assert await engine.call(stub.abort, "c") is True
        others = stub.threads["call"] - {"engine-step"}
        assert len(others) == 1 and threading.current_thread().name not in others

    asyncio.run(asyncio.wait_for(run(), 10))
    assert stub.aborted == ["a", "b", "c"]


def test_a_committed_requests_first_token_comes_before_the_next_steps_even_if_the_loop_lags():
    """commit_prefilled runs on the engine thread and the step right after emits token 2; with
    the event loop busy meanwhile, both reach it in one turn: the first token must come out
    first (it was put after the call returned, behind token 2: tokens swapped on the wire)."""
    import time

    stub = _StubEngine()
    engine = _Engine(stub)

    async def run() -> list[int]:
        engine.start()
        got: list[int] = []

        async def consume() -> None:
            async for out in engine.commit("r", 1, None, 0):
                got.extend(out.new_token_ids)  # the lagging consumer gets them as one output

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the task runs up to its call's future: the commit is queued
        time.sleep(0.3)  # the loop lags: the call and the next step both end meanwhile
        await asyncio.wait_for(task, 5)
        engine.stop()
        return got

    assert asyncio.run(run()) == [1, 2]


def test_an_abort_cancelled_while_a_long_step_holds_the_lock_still_ends_the_stream():
    """The prefill worker's Abort RPC can pass its deadline while a long prefill step holds the
    engine lock; the abort then runs when the step ends, and the request's stream must end too
    (it waited forever, and with it the decode worker's Prefill call: a request hung)."""
    stub = _StubEngine()
    engine = _Engine(stub)
    aborted = stub.aborted

    async def run() -> list[TokenOutput]:
        stream = engine._open("r", None)
        stub.go.clear()
        stub.busy.set()
        engine.start()
        while not stub.threads["step"]:  # a long step
            await asyncio.sleep(0.01)
        task = asyncio.create_task(engine.abort("r"))
        await asyncio.sleep(0.2)
        task.cancel()  # the RPC's deadline
        with pytest.raises(asyncio.CancelledError):
            await task
        stub.busy.clear()
        stub.go.set()  # the step ends; the abort runs

        async def drained() -> list[TokenOutput]:
            return [out async for out in engine._drain("r", stream)]

        try:
            return await asyncio.wait_for(drained(), 5)  # before the fix: TimeoutError
        finally:
            engine.stop()

    got = asyncio.run(run())
    assert aborted == ["r"]
    assert [(o.finished, o.finish_reason) for o in got] == [(True, FinishReason.ABORT)]


def test_build_engine_runs_on_a_thread_that_is_gone_when_it_returns_and_raises_its_error():
    from kvmesh.engine.serving.engine_thread import build_engine

    assert build_engine(lambda: threading.current_thread().name) == "engine-build"
    assert all(t.name != "engine-build" for t in threading.enumerate())
    with pytest.raises(ValueError, match="no model"):
        build_engine(lambda: (_ for _ in ()).throw(ValueError("no model")))
