"""Grammars and logit bias in the engine on the real default model: outputs follow the grammar
(checked with jsonschema), speculation keeps the constrained output, the P/D replay of a
first token is validated, bad grammars are typed errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.agent import grammars
from kvmesh.errors import InvalidRequestError
from tests.integration.preemption import generate_under_preemption

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["sun", "rain", "snow"]}, "maxItems": 3},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Plan a trip: give a city, a number of days and tags as JSON."}]


def _params(grammar: str, **fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 0.0, "grammar": grammar, **fields})


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    grammar = grammars.json_schema(SCHEMA, "schema")
    greedy = llm.chat(ASK, _params(grammar))[0]
    assert greedy.finish_reason == "stop", greedy
    jsonschema.validate(json.loads(greedy.text), SCHEMA)
    sampled = llm.chat([ASK] * 4, _params(grammar, temperature=1.0, seed=7))
    for out in sampled:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    free = llm.chat(ASK, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert free.text != greedy.text  # the grammar changed what the model says


def test_choice_regex_and_cut_by_length(llm):
    choice = llm.chat(ASK, _params(grammars.choice(["yes", "no", "maybe"], "c")))[0]
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    number = llm.chat(ASK, _params(grammars.regex("[0-9]{3}-[0-9]{2}", "r")))[0]
    assert len(number.text) == 6 and number.text[3] == "-" and number.finish_reason == "stop"
    cut = llm.chat(ASK, _params(grammars.json_schema(SCHEMA, "s"), max_tokens=5))[0]
    assert cut.finish_reason == "length"  # reported as cut, not as valid JSON
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_logit_bias_moves_the_greedy_choice(llm):
    plain = llm.chat(ASK, SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    banned = llm.chat(
        ASK, SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((plain, -100.0),))
    )[0]
    assert banned.token_ids[0] != plain
    forced = llm.chat(
        ASK, SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((1234, 100.0),))
    )[0]
    assert forced.token_ids == [1234]


def test_speculation_keeps_the_constrained_output(llm):
    grammar = grammars.json_schema(SCHEMA, "schema")
    reference = llm.chat(ASK, _params(grammar))[0]
    spec = LLM(dtype="fp32", max_num_seqs=8, speculative="ngram", num_speculative_tokens=4)
    echo = [*ASK, {"role": "assistant", "content": reference.text}, *ASK]  # drafts to propose
    out = spec.chat([ASK, echo], _params(grammar))
    assert out[0].text == reference.text
    assert out[1].text == llm.chat(echo, _params(grammar))[0].text
    assert spec.engine.speculator.stats.draft_tokens > 0  # drafts were cut and verified under masks


def test_schema_suite_in_the_engine_with_and_without_eagle(llm):
    """tests/data/agent_schemas.json in the engine: every answer finishes valid for its schema
    or tools; asking for logprobs (every row masked before the draw, not checked after it; on a
    third of the cases) and the engine with a local EAGLE head always drafting answer exactly
    the same."""
    from tests.integration import agent_schemas

    cases = agent_schemas.cases()
    assert len(cases) >= 30
    want = agent_schemas.suite_reference(llm)
    for case, answer in zip(cases, want, strict=True):
        assert answer.finish in ("stop", "tool_calls"), (case["name"], answer)
        agent_schemas.check(case, answer)
    names = [case["name"] for case in cases]
    some = slice(None, None, 3)  # a third of the suite, schemas and tools
    masked = agent_schemas.engine_answers(
        llm, [{**agent_schemas.body(case), "logprobs": True} for case in cases[some]]
    )
    assert list(zip(names[some], masked, strict=True)) == list(zip(names, want, strict=True))[some]
    eagle = LLM(dtype="fp32", max_num_seqs=32, speculative="eagle", speculative_policy="fixed")
    got = agent_schemas.engine_answers(eagle, [agent_schemas.body(case) for case in cases])
    assert list(zip(names, got, strict=True)) == list(zip(names, want, strict=True))
    assert eagle.engine.speculator.stats.draft_tokens > 0


def test_bad_grammar_and_bias_are_typed_errors(llm):
    with pytest.raises(InvalidRequestError, match="grammar"):
        llm.generate("hi", SamplingParams(grammar="start: nope"))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias=((10**7, 1.0),)))


def test_a_prefilled_first_token_is_replayed_into_the_grammar(llm):
    engine = llm.engine
    grammar = grammars.choice(["yes", "no"], "c")
    prompt = llm.tokenizer.encode_chat(ASK)
    params = _params(grammar)
    assert engine.handover.reserve("replay-bad", prompt, params) is not None
    maybe = llm.tokenizer.encode("maybe", add_special_tokens=False)[0]
    with pytest.raises(InvalidRequestError, match="does not follow"):
        engine.handover.commit_prefilled("replay-bad", maybe, None, 0)
    assert "replay-bad" not in engine.constraints
    assert engine.handover.reserve("replay-ok", prompt, params) is not None
    yes = llm.tokenizer.encode("yes", add_special_tokens=False)[0]
    engine.handover.commit_prefilled("replay-ok", yes, None, 0)
    assert "replay-ok" in engine.constraints
    engine.abort("replay-ok")
    assert "replay-ok" not in engine.constraints


def test_preemption_keeps_the_grammar_state(llm):
    """Requests preempted mid-output (their KV recomputed) go on under the same matcher: the
    outputs equal an unpressured run's and stay valid."""
    grammar = grammars.json_schema(SCHEMA, "schema")
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": f"Trip plan {i} as JSON."}])
        for i in range(5)
    ]
    params = _params(grammar, max_tokens=40)
    reference = [o.text for o in llm.generate_ids(prompts, params)]
    outputs, engine = generate_under_preemption(prompts, params)
    assert [o.text for o in outputs] == reference
    for out in outputs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len(engine.constraints) == 0  # every matcher released


def test_grammars_compile_once_off_the_engine_thread(llm, monkeypatch):
    """A request's grammar is compiled by the worker's event loop on a pool thread, never on the
    engine thread that steps the batch; the engine then finds it cached (one compile per
    grammar, by its hash), and the cache keeps at most CACHED grammars."""
    import asyncio
    import hashlib
    import threading

    from kvmesh.engine.serving.async_engine import AsyncEngine

    engine, constraints = llm.engine, llm.engine.constraints
    engine.block_manager.reset_prefix_cache()  # the replay test's pages were never written
    prepare, seen = constraints.prepare, []

    def spy(grammar):
        cached = hashlib.sha256(grammar.encode()).digest() in constraints._compiled
        seen.append((threading.current_thread().name, cached))
        return prepare(grammar)

    grammar = grammars.choice(["compiled", "once"], "c")  # a grammar no other test uses
    monkeypatch.setattr(constraints, "prepare", spy)
    served = AsyncEngine(engine)
    served.start()

    async def run():
        outs = served.generate("compile-once", llm.tokenizer.encode_chat(ASK), _params(grammar))
        return [out async for out in outs]

    try:
        outputs = asyncio.run(run())
    finally:
        served.stop()
    assert "".join(llm.tokenizer.decode(o.new_token_ids) for o in outputs) in ("compiled", "once")
    (first, cached), *later = seen
    assert first != "engine-step" and not cached and later, seen  # compiled off the engine thread
    assert all(cached for _, cached in later), seen  # the engine's copy came from the cache
    monkeypatch.undo()
    assert constraints.prepare(grammar) is constraints.prepare(grammar)
    for i in range(constraints.CACHED + 1):
        constraints.prepare(grammars.choice([f"g{i}"], "c"))
    assert len(constraints._compiled) == constraints.CACHED


def test_a_prefix_hit_keeps_each_requests_grammar(llm):
    """The same prompt again is read from the prefix cache and gives the same constrained
    output; under another grammar the cached prompt carries nothing of the first one's state."""
    llm.engine.block_manager.reset_prefix_cache()
    prompt = llm.tokenizer.encode_chat(
        [{"role": "system", "content": "Answer as asked. " * 20}, *ASK]
    )
    schema = _params(grammars.json_schema(SCHEMA, "schema"), max_tokens=60)
    (cold,) = llm.generate_ids([prompt], schema)
    (hit,) = llm.generate_ids([prompt], schema)
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens >= 16
    assert hit.text == cold.text and hit.finish_reason == cold.finish_reason == "stop"
    jsonschema.validate(json.loads(hit.text), SCHEMA)
    (other,) = llm.generate_ids([prompt], _params(grammars.choice(["rain", "sun"], "c")))
    assert other.num_cached_tokens >= 16 and other.text in ("rain", "sun")
