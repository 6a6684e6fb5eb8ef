"""The full mesh's routing: load spread, session affinity and its yield, prefix-aware routing,
cache salts, and the gRPC Gateway's messages and errors."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh import SamplingParams
from kvmesh.proto.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
)
from tests.integration.full_mesh.helpers import (
    WEATHER,
    decisions,
    metric,
    wait_until_idle,
    workers_of,
)
from tests.integration.mesh_probes import (
    router_caught_up,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)


def test_concurrent_requests_spread_over_workers(client, mesh):

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
    for worker in workers_of(mesh):
        name = (
            "kvmesh_generation_tokens_total"
            if worker.role == "decode"
            else "kvmesh_kv_transfer_bytes_total"
        )
        assert metric(worker.metrics_address, name) > 0, f"{worker.worker_id} got no work"


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
    for worker in workers_of(mesh):
        assert 0 < metric(worker.metrics_address, "kvmesh_grpc_message_bytes_max") < 64 << 10


def test_grpc_gateway_tool_calls_equal_the_rest_ones(mesh, client):
    """Tools, a named choice and the history's calls as proto fields; the reply's call comes
    back as tool_calls pieces equal to what the REST front end answers."""
    import json

    history = [gateway_pb2.ChatMessage(role="user", content="What is the weather in Paris?")]
    weather = WEATHER["function"]
    chat = gateway_pb2.ChatMessages(
        messages=history,
        tools=[
            gateway_pb2.Tool(
                name=weather["name"],
                description=weather["description"],
                parameters_json=json.dumps(weather["parameters"]),
            )
        ],
        tool_choice=gateway_pb2.ToolChoice(mode="named", name="get_weather"),
    )
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        request = gateway_pb2.GenerateRequest(
            chat=chat, sampling=common_pb2.SamplingParams(max_tokens=48, temperature=0.0)
        )
        responses = list(stub.Generate(request, timeout=300))
        pieces = [c for r in responses for c in r.tool_calls]
        bad = gateway_pb2.ChatMessages(
            messages=history, tools=[gateway_pb2.Tool(name="x", parameters_json="{not json")]
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(gateway_pb2.GenerateRequest(chat=bad), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters_json" in info.value.details()
    assert pieces[0].name == "get_weather" and pieces[0].id.startswith("call_")
    rest = (
        client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": history[0].content}],
            max_tokens=48,
            temperature=0,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        .choices[0]
        .message.tool_calls[0]
    )
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
            model="smollm2-135m",
            messages=messages,
            max_tokens=16,
            temperature=0,
            extra_headers={"x-session-affinity": "session-multi-turn"},
        )
        reference.engine.block_manager.reset_prefix_cache()
        want = reference.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))[0]
        assert reply.choices[0].message.content == want.text
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn:
            assert cached >= previous // 16 * 16, (turn, cached, previous)
        previous = reply.usage.prompt_tokens + reply.usage.completion_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    # the completions' pages were only on the decode worker: prefill read them over TE
    read = [
        metric(w.metrics_address, 'kvmesh_kv_transfer_bytes_total{service="prefill:from_decode"}')
        for w in workers_of(mesh)
        if w.role == "prefill"
    ]
    assert sum(read) > 0


def test_cache_salts_isolate_tenants(client):
    messages = [
        {"role": "user", "content": "Summarise the plot of a heist movie in one line. " * 6}
    ]

    def cached(salt: str) -> int:
        reply = client.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            max_tokens=4,
            temperature=0,
            extra_headers={"x-session-affinity": "session-salts", "x-kvmesh-cache-salt": salt},
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") >= 16


def test_prefix_aware_routing_without_affinity(client, mesh):
    manual = "House rules. " + " ".join(
        f"Rule {i}: keep item {i} in drawer {i % 7}." for i in range(60)
    )

    def ask(question: str):
        return client.chat.completions.create(
            model="smollm2-135m",
            max_tokens=4,
            temperature=0,
            messages=[{"role": "system", "content": manual}, {"role": "user", "content": question}],
        )

    first = ask("Where is item 3?")
    assert first.usage.prompt_tokens > 400
    wait_for(lambda: router_caught_up(mesh), 30, "the router's index lags the KV events")
    wait_until_idle(mesh)  # and its load view shows the first request gone
    before = {role: decisions(mesh, role, "prefix_hit") for role in ("prefill", "decode")}
    second = ask("Where is item 5?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 400
    for role in ("prefill", "decode"):
        assert decisions(mesh, role, "prefix_hit") == before[role] + 1


def test_affinity_yields_when_the_pinned_worker_is_overloaded(client, mesh):

    def ask(session: str):
        return client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Hi there"}],
            max_tokens=4,
            temperature=0,
            extra_headers={"x-session-affinity": session},
        )

    wait_until_idle(mesh)  # the yield compares loads: earlier tests' requests must be gone
    ask("session-yield")  # pins the session to some decode worker D
    started, stop = threading.Event(), threading.Event()

    def hog():  # same session, so also on D (D is not loaded yet): 1,000 tokens of load on D
        stream = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Go on and on."}],
            max_tokens=1000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-affinity": "session-yield"},
        )
        for _ in stream:
            started.set()
            if stop.is_set():
                break
        stream.close()

    worker = threading.Thread(target=hog)
    worker.start()
    try:
        assert started.wait(120)
        kept_before = decisions(mesh, "decode", "affinity")
        yielded_before = decisions(mesh, "decode", "affinity_yield_load")
        ask("session-yield")
        assert decisions(mesh, "decode", "affinity_yield_load") > yielded_before
        assert decisions(mesh, "decode", "affinity") == kept_before
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
