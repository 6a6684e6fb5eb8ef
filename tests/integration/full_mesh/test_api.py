"""The full mesh driven with the official openai client (and the agents SDK): its answers equal
the engine's, streamed or not, sampled with a seed, structured, with tools."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh import SamplingParams
from tests.integration.full_mesh.helpers import (
    QUESTIONS,
    TRIP,
    WEATHER,
    metric,
    workers_of,
)

pytestmark = pytest.mark.timeout(900)


def test_models_lists_the_alias(client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_greedy_equals_engine_streamed_and_not(client, reference, question):
    messages = [{"role": "user", "content": question}]
    want = reference.chat(messages, SamplingParams(max_tokens=48, temperature=0.0))[0]
    full = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=48, temperature=0
    )
    assert full.choices[0].message.content == want.text
    assert full.usage.completion_tokens == len(want.token_ids)
    assert full.choices[0].finish_reason == want.finish_reason
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=48, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_seeded_sampling_through_the_mesh_equals_the_engine(client, reference):
    """Prefill samples the first token, decode the rest: decode's generator continues where
    prefill's stopped, so a seed gives the engine's tokens."""
    messages = [{"role": "user", "content": "Tell me a story about a dragon."}]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    want = reference.chat(messages, params)[0]
    got = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
    )
    assert got.choices[0].message.content == want.text
    two = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        n=2,
    )
    second = reference.chat(
        messages, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1235)
    )[0]
    assert [c.message.content for c in two.choices] == [want.text, second.text]


def test_n_choices_prefill_the_prompt_once(mesh, client):
    """n = 2 on a prompt never sent before, two prefill workers: the second choice starts once
    the first has its first token, is routed to the worker that holds the prompt's pages and
    reads its full pages from the prefix cache."""
    question = "Describe the old harbour of a fishing town at dawn, in detail. " * 8
    before = metric(f"127.0.0.1:{mesh.http_port}", "kvmesh_prompt_cached_tokens_total")
    reply = client.chat.completions.create(
        model="smollm2-135m",
        n=2,
        max_tokens=8,
        temperature=0.8,
        seed=7,
        messages=[{"role": "user", "content": question}],
    )
    cached = metric(f"127.0.0.1:{mesh.http_port}", "kvmesh_prompt_cached_tokens_total") - before
    assert len(reply.choices) == 2 and reply.usage.prompt_tokens > 100
    assert cached >= 16 * (reply.usage.prompt_tokens // 16 - 1), (cached, reply.usage)


def test_completion_greedy_equals_engine_streamed_and_not(client, reference):
    prompt = "The three primary colours are"
    want = reference.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0))[0]
    full = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=32, temperature=0
    )
    assert full.choices[0].text == want.text
    stream = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=32, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text


def test_streamed_tokens_come_on_each_decode_workers_delivery_socket(client, mesh, reference):
    """Concurrent streams spread over both decode workers; the gateway holds one connection to
    each worker's advertised delivery socket, and the streamed text is the engine's."""
    import psutil

    prompt = "A short list of fruits:"
    want = reference.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0))[0].text

    def streamed(_) -> str:
        stream = client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(streamed, range(4))) == [want] * 4
    sockets = {w.delivery_address for w in workers_of(mesh) if w.role == "decode"}
    assert len(sockets) == 2 and "" not in sockets
    gateway = psutil.Process(mesh.procs["gateway"].pid)
    connected = {
        f"{c.raddr.ip}:{c.raddr.port}"
        for c in gateway.net_connections("tcp")
        if c.raddr and c.status == psutil.CONN_ESTABLISHED
    }
    assert sockets <= connected
    from kvmesh.mesh.status import _collect

    described = asyncio.run(_collect(mesh.etcd.endpoint, "default"))
    assert {w["delivery"] for w in described if w["role"] == "decode"} == sockets


def test_structured_output_through_the_mesh_equals_the_engine(client, reference):
    import json

    import jsonschema
    from pydantic import BaseModel

    from kvmesh.agent import grammars

    messages = [{"role": "user", "content": "Plan a trip: a city and a number of days, as JSON."}]
    params = SamplingParams(
        max_tokens=48, temperature=0.0, grammar=grammars.json_schema(TRIP, "schema")
    )
    want = reference.chat(messages, params)[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    full = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=48, temperature=0, response_format=fmt
    )
    assert full.choices[0].message.content == want.text
    jsonschema.validate(json.loads(want.text), TRIP)

    class Trip(BaseModel):
        city: str
        days: int

    parsed = client.chat.completions.parse(
        model="smollm2-135m", messages=messages, max_tokens=48, temperature=0, response_format=Trip
    )
    assert isinstance(parsed.choices[0].message.parsed, Trip)


def test_schema_suite_through_the_mesh_equals_the_engine(client, llm):
    """Every schema and tool set of tests/data/agent_schemas.json, all in flight at once: the
    mesh answers exactly what the engine does, every answer valid for its schema / tools; a
    reply cut by max_tokens says length and is not passed off as JSON."""
    import json

    import openai
    from pydantic import BaseModel

    from tests.integration import agent_schemas

    cases = agent_schemas.cases()
    want = agent_schemas.suite_reference(llm)
    bodies = [agent_schemas.body(case) for case in cases]
    got = agent_schemas.mesh_answers(client, bodies, in_flight=32)  # no drafts: 32 rows at most
    for case, answer, expected in zip(cases, got, want, strict=True):
        assert answer == expected, case["name"]
        agent_schemas.check(case, answer)
    assert sum(a.finish in ("stop", "tool_calls") for a in got) == len(cases)
    cut = [c for c in cases if "schema" in c][:2]
    for answer in agent_schemas.mesh_answers(client, [agent_schemas.body(c, 6) for c in cut]):
        assert answer.finish == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(answer.content)

    class Character(BaseModel):
        name: str
        strength: int

    with pytest.raises(openai.LengthFinishReasonError):  # the SDK sees the cut too
        client.chat.completions.parse(
            model="smollm2-135m",
            max_tokens=4,
            temperature=0,
            messages=[{"role": "user", "content": "A hero?"}],
            response_format=Character,
        )


def test_forced_tool_call_through_the_mesh_streamed_and_not(client):
    import json

    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    fields = dict(
        model="smollm2-135m",
        messages=messages,
        max_tokens=48,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    full = client.chat.completions.create(**fields)
    assert full.choices[0].finish_reason == "tool_calls"
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    name, arguments = None, ""
    for chunk in client.chat.completions.create(**fields, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name = delta.function.name or name
            arguments += delta.function.arguments or ""
    assert (name, arguments) == ("get_weather", call.function.arguments)


def test_an_openai_agents_sdk_loop_runs_to_the_end(mesh):
    """A real agent framework's loop over two tools: a forced call (tool_choice required, then
    reset to auto by the SDK), the tool's result sent back, a final answer; nothing is sent
    anywhere but the mesh (the SDK's tracing is off)."""
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", city))
        return f"It is 18 degrees and sunny in {city}."

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return "It is 9:00."

    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the tools' results.",
        tools=[get_weather, get_time],
        model=agents.OpenAIChatCompletionsModel(model="smollm2-135m", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [item.type for item in result.new_items]
    made = kinds.count("tool_call_item")
    assert made >= 1 and kinds.count("tool_call_output_item") == made == len(calls), kinds
    assert kinds[0] == "tool_call_item" and kinds[-1] == "message_output_item", kinds
    # every turn in protocol: each call answered by its own id before the next model turn
    asked = [i.raw_item.call_id for i in result.new_items if i.type == "tool_call_item"]
    answered = [
        i.raw_item["call_id"] for i in result.new_items if i.type == "tool_call_output_item"
    ]
    assert asked == answered and len(set(asked)) == made, (asked, answered)
    turns = [[o for o in r.output if o.type == "function_call"] for r in result.raw_responses]
    assert sum(map(len, turns)) == made and turns[0] and not turns[-1], turns  # calls, an answer
    assert all(name in ("get_weather", "get_time") and city for name, city in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
