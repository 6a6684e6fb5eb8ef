"""A migrated request goes on where another worker left it (`resumed` tokens): greedy, seeded
sampling, penalties and grammars continue exactly as if the request had never moved, locally
and through the P/D hand-over (reserve + a prefill of the prompt and the resumed tokens)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kvmesh import SamplingParams
from kvmesh.agent import grammars
from kvmesh.engine.serving.async_engine import AsyncEngine
from kvmesh.errors import InvalidRequestError

_ids = itertools.count()
ASK = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _run(engine, prompt: list[int], params: SamplingParams, resumed=()) -> list[int]:
    rid = f"resume-{next(_ids)}"
    engine.add_request(rid, prompt, params, resumed=list(resumed))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens.extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11),
        SamplingParams(
            max_tokens=24,
            temperature=0.0,
            frequency_penalty=1.5,
            presence_penalty=0.5,
            repetition_penalty=1.3,
        ),
        SamplingParams(
            max_tokens=40, temperature=0.0, grammar=grammars.json_schema(SCHEMA, "person")
        ),
    ],
    ids=["greedy", "seeded", "penalties", "grammar"],
)
def test_resumed_request_continues_exactly(llm, params):
    engine = llm.engine
    prompt = llm.tokenizer.encode_chat(ASK)
    whole = _run(engine, prompt, params)
    assert len(whole) > 10
    for cut in (1, 7, len(whole) - 1):
        rest = _run(engine, prompt, params, whole[:cut])
        assert whole[:cut] + rest == whole, cut


def test_resumed_through_reserve_and_prefill(llm):
    """The P/D path on one engine: a prefill of prompt + resumed (its next token), then a
    reservation committed with that token, decoding the rest."""
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=1.0)
    prompt = llm.tokenizer.encode_chat(ASK)
    whole = _run(engine, prompt, params)
    resumed = whole[:6]

    async def hand_over() -> list[int]:
        runner = AsyncEngine(engine)
        runner.start()
        try:
            first = await runner.prefill("p-resume", prompt, params, resumed=resumed)
            await runner.release("p-resume")
            assert first.num_prompt_tokens == len(prompt)
            reservation = await runner.reserve("d-resume", prompt, params, resumed=resumed)
            assert reservation is not None
            await runner.cancel_reservation("d-resume")  # the pages were not written here
            return list(first.new_token_ids)
        finally:
            runner.stop()

    assert asyncio.run(hand_over()) == whole[6:7]


def test_resumed_tokens_are_checked(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode_chat(ASK)
    with pytest.raises(InvalidRequestError, match="leave nothing to generate"):
        engine.add_request("r-full", prompt, SamplingParams(max_tokens=3), resumed=[1, 2, 3])
    grammar = grammars.json_schema(SCHEMA, "person")
    not_json = llm.tokenizer.encode("hello")
    with pytest.raises(InvalidRequestError, match="do not follow the request's grammar"):
        engine.add_request(
            "r-bad", prompt, SamplingParams(max_tokens=9, grammar=grammar), resumed=not_json
        )
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("r-vocab", prompt, SamplingParams(max_tokens=9), resumed=[10**8])
    assert not engine.has_unfinished()
