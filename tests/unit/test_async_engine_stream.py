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
