"""The mesh as real processes on loopback: etcd + gateway + 2 prefill + 2 decode workers,
driven with the official openai client. Fault tests run last (they kill workers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import gateway_config, worker_configs
from kvmesh.proto.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)
from tests.integration.mesh_probes import (
    module_mesh,
    pages_in_use,
    router_caught_up,
    router_sees_idle,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn."]


@pytest.fixture(scope="module")
def mesh():
    options = UpOptions(
        workers=worker_configs("--kv-cache-mib", "96", "--max-num-seqs", "16"),
        prefill=2,
        decode=2,
        gateway=gateway_config("--affinity-slack-tokens", "600"),
    )
    with module_mesh(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh):
    from openai import OpenAI

    return OpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
    )


@pytest.fixture(scope="module")
def reference():
    return LLM(dtype="fp32", kv_cache_bytes=160 << 20)


def _workers(mesh):
    return asyncio.run(list_workers(mesh.etcd.endpoint, "default"))


def _metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


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
    got = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                         temperature=0.9, top_p=0.95, seed=1234)  # fmt: skip
    assert got.choices[0].message.content == want.text
    two = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                         temperature=0.9, top_p=0.95, seed=1234, n=2)  # fmt: skip
    second = reference.chat(messages, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95,
                                                     seed=1235))[0]  # fmt: skip
    assert [c.message.content for c in two.choices] == [want.text, second.text]


def test_n_choices_prefill_the_prompt_once(mesh, client):
    """n = 2 on a prompt never sent before, two prefill workers: the second choice starts once
    the first has its first token, is routed to the worker that holds the prompt's pages and
    reads its full pages from the prefix cache."""
    question = "Describe the old harbour of a fishing town at dawn, in detail. " * 8
    before = _metric(f"127.0.0.1:{mesh.http_port}", "kvmesh_prompt_cached_tokens_total")
    reply = client.chat.completions.create(model="smollm2-135m", n=2, max_tokens=8, temperature=0.8,
                                           seed=7, messages=[{"role": "user", "content": question}])  # fmt: skip
    cached = _metric(f"127.0.0.1:{mesh.http_port}", "kvmesh_prompt_cached_tokens_total") - before
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
    sockets = {w.delivery_address for w in _workers(mesh) if w.role == "decode"}
    assert len(sockets) == 2 and "" not in sockets
    gateway = psutil.Process(mesh.procs["gateway"].pid)
    connected = {f"{c.raddr.ip}:{c.raddr.port}" for c in gateway.net_connections("tcp")
                 if c.raddr and c.status == psutil.CONN_ESTABLISHED}  # fmt: skip
    assert sockets <= connected
    from kvmesh.mesh.status import _collect

    described = asyncio.run(_collect(mesh.etcd.endpoint, "default"))
    assert {w["delivery"] for w in described if w["role"] == "decode"} == sockets


TRIP = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False,
}  # fmt: skip
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}  # fmt: skip


def test_structured_output_through_the_mesh_equals_the_engine(client, reference):
    import json

    import jsonschema
    from pydantic import BaseModel

    from kvmesh.agent import grammars

    messages = [{"role": "user", "content": "Plan a trip: a city and a number of days, as JSON."}]
    params = SamplingParams(max_tokens=48, temperature=0.0,
                            grammar=grammars.json_schema(TRIP, "schema"))  # fmt: skip
    want = reference.chat(messages, params)[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    full = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                          max_tokens=48, temperature=0, response_format=fmt)  # fmt: skip
    assert full.choices[0].message.content == want.text
    jsonschema.validate(json.loads(want.text), TRIP)

    class Trip(BaseModel):
        city: str
        days: int

    parsed = client.chat.completions.parse(model="smollm2-135m", messages=messages,
                                           max_tokens=48, temperature=0, response_format=Trip)  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, Trip)


def test_schema_suite_through_the_mesh_equals_the_engine(client, llm):
    """Every schema and tool set of tests/data/agent_schemas.json, four in flight at once: the
    mesh answers exactly what the engine does, every answer valid for its schema / tools; a
    reply cut by max_tokens says length and is not passed off as JSON."""
    import json

    import openai
    from pydantic import BaseModel

    from tests.integration import agent_schemas

    cases = agent_schemas.cases()
    want = agent_schemas.suite_reference(llm)
    got = agent_schemas.mesh_answers(client, [agent_schemas.body(case) for case in cases])
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
        client.chat.completions.parse(model="smollm2-135m", max_tokens=4, temperature=0,
                                      messages=[{"role": "user", "content": "A hero?"}],
                                      response_format=Character)  # fmt: skip


def test_forced_tool_call_through_the_mesh_streamed_and_not(client):
    import json

    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    fields = dict(model="smollm2-135m", messages=messages, max_tokens=48, temperature=0,
                  tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
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

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused",
                         max_retries=0)  # fmt: skip
    agent = agents.Agent(
        name="weather", instructions="Answer with the tools' results.",
        tools=[get_weather, get_time],
        model=agents.OpenAIChatCompletionsModel(model="smollm2-135m", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=64),
    )  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [item.type for item in result.new_items]
    made = kinds.count("tool_call_item")
    assert made >= 1 and kinds.count("tool_call_output_item") == made == len(calls), kinds
    assert kinds[0] == "tool_call_item" and kinds[-1] == "message_output_item", kinds
    # every turn in protocol: each call answered by its own id before the next model turn
    asked = [i.raw_item.call_id for i in result.new_items if i.type == "tool_call_item"]
    answered = [i.raw_item["call_id"] for i in result.new_items
                if i.type == "tool_call_output_item"]  # fmt: skip
    assert asked == answered and len(set(asked)) == made, (asked, answered)
    turns = [[o for o in r.output if o.type == "function_call"] for r in result.raw_responses]
    assert sum(map(len, turns)) == made and turns[0] and not turns[-1], turns  # calls, an answer
    assert all(name in ("get_weather", "get_time") and city for name, city in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_concurrent_requests_spread_over_workers(client, mesh):
    from concurrent.futures import ThreadPoolExecutor

    def ask(i):
        return client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": f"Say a word about {i}."}],
            max_tokens=24,
            temperature=0,
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    assert all(r.choices[0].message.content for r in results)
    for worker in _workers(mesh):
        name = (
            "kvmesh_generation_tokens_total"
            if worker.role == "decode"
            else "kvmesh_kv_transfer_bytes_total"
        )
        assert _metric(worker.metrics_address, name) > 0, f"{worker.worker_id} got no work"


def test_grpc_gateway_long_prompt_messages_stay_small(mesh, reference):
    text = " ".join(f"item{i}" for i in range(1000))
    ids = reference.tokenizer.encode(text)[:2000]
    assert len(ids) >= 1900
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0),
        )
        responses = list(stub.Generate(request, timeout=300))
    want = reference.generate_ids([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert [t for r in responses for t in r.token_ids] == want.token_ids
    assert responses[-1].usage.prompt_tokens == len(ids)
    assert max(r.ByteSize() for r in responses) < 64 << 10 and request.ByteSize() < 64 << 10
    for worker in _workers(mesh):
        assert 0 < _metric(worker.metrics_address, "kvmesh_grpc_message_bytes_max") < 64 << 10


def test_grpc_gateway_tool_calls_equal_the_rest_ones(mesh, client):
    """Tools, a named choice and the history's calls as proto fields; the reply's call comes
    back as tool_calls pieces equal to what the REST front end answers."""
    import json

    history = [gateway_pb2.ChatMessage(role="user", content="What is the weather in Paris?")]
    weather = WEATHER["function"]
    chat = gateway_pb2.ChatMessages(
        messages=history,
        tools=[gateway_pb2.Tool(name=weather["name"], description=weather["description"],
                                parameters_json=json.dumps(weather["parameters"]))],
        tool_choice=gateway_pb2.ToolChoice(mode="named", name="get_weather"),
    )  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        request = gateway_pb2.GenerateRequest(
            chat=chat, sampling=common_pb2.SamplingParams(max_tokens=48, temperature=0.0)
        )
        responses = list(stub.Generate(request, timeout=300))
        pieces = [c for r in responses for c in r.tool_calls]
        bad = gateway_pb2.ChatMessages(messages=history, tools=[gateway_pb2.Tool(
            name="x", parameters_json="{not json")])  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(gateway_pb2.GenerateRequest(chat=bad), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters_json" in info.value.details()
    assert pieces[0].name == "get_weather" and pieces[0].id.startswith("call_")
    rest = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": history[0].content}],
        max_tokens=48, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0].message.tool_calls[0]  # fmt: skip
    assert "".join(p.arguments for p in pieces) == rest.function.arguments
    assert "".join(r.text for r in responses) == ""  # the reply is the call alone


def test_bad_requests_get_openai_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-135m", messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=4
        )


def test_multi_turn_with_affinity_hits_the_cache_and_matches_uncached(client, mesh, reference):
    messages = [{"role": "system", "content": "You are a terse assistant. Answer in a few words."}]
    previous = 0
    for turn, question in enumerate(
        ["Name a fruit.", "Name a colour.", "Name an animal.", "And a city?"]
    ):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=16, temperature=0,
            extra_headers={"x-session-affinity": "session-multi-turn"},
        )  # fmt: skip
        reference.engine.block_manager.reset_prefix_cache()
        want = reference.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))[0]
        assert reply.choices[0].message.content == want.text
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn:
            assert cached >= previous // 16 * 16, (turn, cached, previous)
        previous = reply.usage.prompt_tokens + reply.usage.completion_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    # the completions' pages were only on the decode worker: prefill read them over TE
    read = [_metric(w.metrics_address, 'kvmesh_kv_transfer_bytes_total{service="prefill:from_decode"}')
            for w in _workers(mesh) if w.role == "prefill"]  # fmt: skip
    assert sum(read) > 0


def test_cache_salts_isolate_tenants(client):
    messages = [
        {"role": "user", "content": "Summarise the plot of a heist movie in one line. " * 6}
    ]

    def cached(salt: str) -> int:
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=4, temperature=0,
            extra_headers={"x-session-affinity": "session-salts", "x-kvmesh-cache-salt": salt},
        )  # fmt: skip
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") >= 16


def _decisions(mesh, role: str, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.http_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    wanted = f'role="{role}"', f'reason="{reason}"'
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvmesh_routing_decisions_total{") and all(w in line for w in wanted))  # fmt: skip


def test_prefix_aware_routing_without_affinity(client, mesh):
    manual = "House rules. " + " ".join(
        f"Rule {i}: keep item {i} in drawer {i % 7}." for i in range(60)
    )

    def ask(question: str):
        return client.chat.completions.create(
            model="smollm2-135m", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": manual}, {"role": "user", "content": question}],
        )  # fmt: skip

    first = ask("Where is item 3?")
    assert first.usage.prompt_tokens > 400
    wait_for(lambda: router_caught_up(mesh), 30, "the router's index lags the KV events")
    _wait_until_idle(mesh)  # and its load view shows the first request gone
    before = {role: _decisions(mesh, role, "prefix_hit") for role in ("prefill", "decode")}
    second = ask("Where is item 5?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 400
    for role in ("prefill", "decode"):
        assert _decisions(mesh, role, "prefix_hit") == before[role] + 1


def test_affinity_yields_when_the_pinned_worker_is_overloaded(client, mesh):
    import threading

    def ask(session: str):
        return client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Hi there"}], max_tokens=4,
            temperature=0, extra_headers={"x-session-affinity": session},
        )  # fmt: skip

    _wait_until_idle(mesh)  # the yield compares loads: earlier tests' requests must be gone
    ask("session-yield")  # pins the session to some decode worker D
    started, stop = threading.Event(), threading.Event()

    def hog():  # same session, so also on D (D is not loaded yet): 1,000 tokens of load on D
        stream = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Go on and on."}],
            max_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True},
            extra_headers={"x-session-affinity": "session-yield"},
        )  # fmt: skip
        for _ in stream:
            started.set()
            if stop.is_set():
                break
        stream.close()

    worker = threading.Thread(target=hog)
    worker.start()
    try:
        assert started.wait(120)
        kept_before = _decisions(mesh, "decode", "affinity")
        yielded_before = _decisions(mesh, "decode", "affinity_yield_load")
        ask("session-yield")
        assert _decisions(mesh, "decode", "affinity_yield_load") > yielded_before
        assert _decisions(mesh, "decode", "affinity") == kept_before
    finally:
        stop.set()
        worker.join(60)


def test_grpc_gateway_bad_input_statuses(mesh):
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        cases = [
            (gateway_pb2.GenerateRequest(model="nope", prompt="hi"), grpc.StatusCode.NOT_FOUND),
            (
                gateway_pb2.GenerateRequest(
                    prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=0)
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (gateway_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
            (
                gateway_pb2.GenerateRequest(
                    prompt="hi", sampling=common_pb2.SamplingParams(temperature=9)
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ]
        for request, status in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == status and info.value.details()


def _wait_until_idle(mesh, timeout_s: float = 60.0) -> None:
    """No worker has tokens in flight, as the gateway's load poll last saw them."""
    wait_for(lambda: router_sees_idle(mesh), timeout_s, "workers still busy after earlier tests")


def test_client_disconnect_frees_pages(client, mesh):
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Count to one thousand."}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 20
    while (used := pages_in_use(mesh)) and time.time() < deadline:
        time.sleep(0.5)
    assert used == 0, "pages stranded on a prefill or decode worker after the client left"


def test_decode_abort_while_its_prefill_runs_ends_the_request(mesh):
    """Decode.Abort arriving while the prefill worker computes the prompt: the prefill is told
    to stop, the stream ends with finish reason abort and no token, no page stays held."""
    workers = _workers(mesh)
    decode = next(w for w in workers if w.role == "decode")
    prefill = next(w for w in workers if w.role == "prefill")
    with (
        grpc.insecure_channel(decode.grpc_address) as d,
        grpc.insecure_channel(prefill.grpc_address) as p,
    ):
        stub, prefill_stub = decode_pb2_grpc.DecodeStub(d), prefill_pb2_grpc.PrefillStub(p)
        call = stub.Generate(decode_pb2.DecodeRequest(
            request_id="abort-during-prefill", prompt_token_ids=list(range(3000, 4200)),
            sampling=common_pb2.SamplingParams(max_tokens=64, temperature=0),
            prefill_address=prefill.grpc_address,
        ), timeout=120)  # fmt: skip

        def prefilling() -> bool:
            loads = prefill_stub.GetLoads(decode_pb2.GetLoadsRequest(), timeout=5).loads
            return loads[0].num_running + loads[0].num_waiting > 0

        wait_for(prefilling, 60, "the prefill worker never started the prompt")
        assert stub.Abort(
            decode_pb2.AbortRequest(request_id="abort-during-prefill"), timeout=10
        ).aborted
        responses = list(call)
    assert [t for r in responses for t in r.token_ids] == []
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    wait_for(lambda: pages_in_use(mesh) == 0, 30, "pages held after the abort")


def test_a_delivery_stream_carries_several_requests_chunks_per_message(mesh):
    """Decode.Deliver: requests naming an open delivery stream get every chunk but the last on
    it, several requests' chunks in one message; put in order by first_index, their tokens are
    those of the same requests without one. No id, or an id already open, is refused."""
    decode = next(w for w in _workers(mesh) if w.role == "decode")
    sampling = common_pb2.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = {f"delivered-{i}": list(range(2000 + 7 * i, 2030 + 7 * i)) for i in range(3)}
    with grpc.insecure_channel(decode.grpc_address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)

        def generate(request_id: str, delivery_id: str = "") -> list:
            return list(stub.Generate(decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompts[request_id.removesuffix("-alone")],
                sampling=sampling, delivery_id=delivery_id,
            ), timeout=120))  # fmt: skip

        alone = {rid: [t for r in generate(f"{rid}-alone") for t in r.token_ids] for rid in prompts}
        with pytest.raises(grpc.RpcError) as unnamed:
            next(stub.Deliver(decode_pb2.DeliverRequest(), timeout=10))
        assert unnamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        deliver = stub.Deliver(decode_pb2.DeliverRequest(delivery_id="t-1"), timeout=120)
        messages: list = []

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                messages.extend(deliver)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        with ThreadPoolExecutor(3) as pool:
            own = dict(zip(prompts, pool.map(lambda rid: generate(rid, "t-1"), prompts),
                           strict=True))  # fmt: skip

        def tokens() -> int:
            chunks = [r for m in messages for r in m.responses] + sum(own.values(), [])
            return sum(len(r.token_ids) for r in chunks)

        wait_for(lambda: tokens() == 3 * 48, 30, "delivered tokens missing")
        with pytest.raises(grpc.RpcError) as twice:
            next(stub.Deliver(decode_pb2.DeliverRequest(delivery_id="t-1"), timeout=10))
        assert twice.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        deliver.cancel()
        reader.join(10)
    delivered = [r for m in messages for r in m.responses]
    assert any(len({r.request_id for r in m.responses}) > 1 for m in messages)
    for rid, responses in own.items():
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # last: on Generate
        chunks = sorted(responses + [r for r in delivered if r.request_id == rid],
                        key=lambda r: r.first_index)  # fmt: skip
        assert [t for r in chunks for t in r.token_ids] == alone[rid]
        assert len([r for r in delivered if r.request_id == rid]) > 0


def test_kill_prefill_then_requests_still_succeed(client, mesh):
    victim = mesh.procs["prefill-0"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    for i in range(3):
        r = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": f"Hi {i}"}],
            max_tokens=8,
            temperature=0,
        )
        assert r.choices[0].message.content


def test_kill_decode_mid_stream_the_stream_goes_on_elsewhere(client, mesh, reference):
    """The stream migrates to the other decode worker (test_mesh_faults has the full case)."""
    ask = [{"role": "user", "content": "Tell me a long story."}]
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=ask, max_tokens=64, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = []
    for i, chunk in enumerate(stream):
        text.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        if i == 2:
            _kill_busy_decode(mesh)  # the decode worker serving this stream
    want = reference.chat(ask, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert "".join(text) == want[0].text
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content


def _kill_busy_decode(mesh) -> None:
    for worker in _workers(mesh):
        if worker.role == "decode" and _metric(worker.metrics_address, "kvmesh_kv_pages_used") > 0:
            proc = mesh.procs[worker.worker_id]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            return
    raise AssertionError("no decode worker holds pages mid-stream")
