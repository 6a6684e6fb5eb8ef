"""A request's output stream out of the engine thread: what piled up while its consumer was busy
comes out as one output (fewer gRPC messages), errors and the finish never merged away."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.outputs import TokenLogprob, TokenOutput
from kvmesh.engine.sequence import FinishReason
from kvmesh.errors import EngineFailure


def _out(token: int, finished: bool = False) -> TokenOutput:
    logprob = TokenLogprob(token, -0.5, 1, ())
    reason = FinishReason.LENGTH if finished else None
    return TokenOutput("r", [token], [logprob], finished, reason, 7, 3)


def _drained(items: list) -> tuple[list[TokenOutput], BaseException | None]:
    engine = AsyncEngine.__new__(AsyncEngine)  # only the stream side: no engine thread
    engine._queues = {}

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        got: list[TokenOutput] = []
        try:
            async for out in engine._drain("r", queue):
                got.append(out)
        except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
            return got, exc
        return got, None

    return asyncio.run(run())


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


def test_an_abort_cancelled_while_a_long_step_holds_the_lock_still_ends_the_stream():
    """The prefill worker's Abort RPC can pass its deadline while a long prefill step holds the
    engine lock; the abort then runs when the step ends, and the request's stream must end too
    (it waited forever, and with it the decode worker's Prefill call: a request hung)."""
    import threading

    aborted: list[str] = []

    class Stub:
        def abort(self, request_id: str) -> bool:
            aborted.append(request_id)
            return True

    engine = AsyncEngine.__new__(AsyncEngine)  # no engine thread: the test holds the lock
    engine._engine, engine._lock, engine._wake = Stub(), threading.Lock(), threading.Event()
    engine._queues, engine._measure_load = {}, lambda: None

    async def run() -> list[TokenOutput]:
        queue = engine._open("r")
        engine._lock.acquire()  # a long step
        task = asyncio.create_task(engine.abort("r"))
        await asyncio.sleep(0.2)
        task.cancel()  # the RPC's deadline
        with pytest.raises(asyncio.CancelledError):
            await task
        engine._lock.release()  # the step ends; the abort runs

        async def drained() -> list[TokenOutput]:
            return [out async for out in engine._drain("r", queue)]

        return await asyncio.wait_for(drained(), 5)  # before the fix: TimeoutError

    got = asyncio.run(run())
    assert aborted == ["r"]
    assert [(o.finished, o.finish_reason) for o in got] == [(True, FinishReason.ABORT)]
