"""Overload, deadlines and limits on a live mesh (1 prefill + 1 decode worker, each holding at
most 4 requests): past capacity the gateway answers 429 with Retry-After (gRPC:
RESOURCE_EXHAUSTED) and the accepted requests finish with the engine's text; a request's
deadline ends it with 504 / DEADLINE_EXCEEDED and frees its pages; requests above the configured
limits get 400 / 413 naming the limit."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.launcher import UpOptions
from kvmesh.mesh.up_config import gateway_config, worker_configs
from kvmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.mesh_probes import mesh_with_env, pages_in_use, wait_for

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2-135m"
CAPACITY = 4  # --max-queued-requests of each worker


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("otel") / "spans.jsonl"


@pytest.fixture(scope="module")
def mesh(traces):
    options = UpOptions(
        workers=worker_configs(
            "--kv-cache-mib",
            "64",
            "--max-num-seqs",
            str(CAPACITY),
            "--max-queued-requests",
            str(CAPACITY),
        ),
        prefill=1,
        decode=1,
        kvstore="none",
        gateway=gateway_config(
            "--max-prompt-tokens",
            "200",
            "--max-output-tokens",
            "100",
            "--max-n",
            "2",
            "--max-request-body-bytes",
            "20000",
        ),
    )
    with mesh_with_env(options, KVMESH_OTEL_FILE=str(traces)) as running:  # traces on, to a file
        yield running


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=f"http://127.0.0.1:{mesh.http_port}", timeout=120) as client:
        yield client


def _chat(topic: str, max_tokens: int = 32, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"A story about {topic}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def test_four_times_capacity_gets_429s_and_the_rest_the_engines_text(http, mesh):
    topics = [f"topic {i}" for i in range(4 * CAPACITY)]
    go = threading.Barrier(len(topics))

    def post(topic: str) -> httpx.Response:
        go.wait(30)
        return http.post("/v1/chat/completions", json=_chat(topic))

    with ThreadPoolExecutor(len(topics)) as pool:
        replies = dict(zip(topics, pool.map(post, topics), strict=True))
    refused = {t: r for t, r in replies.items() if r.status_code == 429}
    served = {t: r for t, r in replies.items() if r.status_code == 200}
    assert len(refused) + len(served) == len(topics), {r.status_code for r in replies.values()}
    assert refused and len(served) >= CAPACITY
    for reply in refused.values():
        assert reply.headers["retry-after"] == "1"
        error = reply.json()["error"]
        assert error["code"] == "overloaded" and error["type"] == "rate_limit_error"
        assert "--max-queued-requests" in error["message"]
    with LLM(dtype="fp32", kv_cache_bytes=64 << 20) as llm:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        for topic, reply in served.items():
            want = llm.chat(_chat(topic)["messages"], params)[0].text
            assert reply.json()["choices"][0]["message"]["content"] == want
    wait_for(lambda: pages_in_use(mesh) == 0, 60, "pages held after the overload")


def test_grpc_gateway_over_capacity_is_resource_exhausted(http, mesh):
    started = threading.Semaphore(0)

    def hold(topic: str) -> int:
        with http.stream(
            "POST", "/v1/chat/completions", json=_chat(topic, 100, stream=True)
        ) as reply:
            lines = reply.iter_lines()
            next(lines)
            started.release()
            return sum(1 for _ in lines)

    request = gateway_pb2.GenerateRequest(
        prompt="Hello", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    )
    with ThreadPoolExecutor(CAPACITY) as pool:
        holders = [pool.submit(hold, f"hold {i}") for i in range(CAPACITY)]
        for _ in holders:
            assert started.acquire(timeout=60)
        with (
            grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60))
        for holder in holders:
            assert holder.result(timeout=120) > 0
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "overloaded" in refused.value.details()


def test_a_request_past_its_deadline_gets_504_and_frees_its_pages(http, mesh):
    reply = http.post(
        "/v1/chat/completions", json=_chat("time", 100), headers={"x-request-timeout": "0.3"}
    )
    assert reply.status_code == 504
    assert reply.json()["error"]["code"] == "deadline_exceeded"
    bad = http.post("/v1/chat/completions", json=_chat("time"), headers={"x-request-timeout": "x"})
    assert bad.status_code == 400 and "x-request-timeout" in bad.json()["error"]["message"]
    request = gateway_pb2.GenerateRequest(
        prompt="Tell me a story.",
        sampling=common_pb2.SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
    )
    with (
        grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel,
        pytest.raises(grpc.RpcError) as late,
    ):
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=0.3))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: pages_in_use(mesh) == 0, 30, "pages held after the deadlines passed")


def test_requests_above_the_configured_limits_name_the_limit(http):
    cases = [
        (_chat("a " * 300), 400, "--max-prompt-tokens"),
        (_chat("cats", 101), 400, "--max-output-tokens"),
        (_chat("cats", n=3), 400, "--max-n"),
        (_chat("x" * 30000), 413, "--max-request-body-bytes"),
    ]
    for body, status, flag in cases:
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == status, (flag, reply.text)
        assert flag in reply.json()["error"]["message"]
    anthropic = http.post(
        "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 101,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert anthropic.status_code == 400
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    assert "--max-output-tokens" in anthropic.json()["error"]["message"]


def test_one_trace_runs_gateway_decode_prefill_transfer(http, traces):
    """W3C trace context through gRPC metadata: one request, one trace, each hop the child of
    the one before (a prompt above the decode worker's local-prefill threshold goes to the
    prefill worker)."""

    def spans() -> list[dict]:
        text = traces.read_text() if traces.exists() else ""
        whole = text[: text.rfind("\n") + 1]  # a line being written is read next time
        return [json.loads(line) for line in whole.splitlines()]

    earlier = len(spans())  # this request's spans come after these
    long = "Tell me about " + ", ".join(f"city {i}" for i in range(25))
    reply = http.post("/v1/chat/completions", json=_chat(long, 4))
    assert reply.status_code == 200, reply.text

    hops = [
        "gateway.generate",
        "gateway.decode_call",
        "decode.generate",
        "decode.prefill_call",
        "prefill.prefill",
        "prefill.transfer",
    ]

    def last_trace() -> dict[str, dict]:
        """The spans of this request's trace (that of its transfer), by name: each process
        exports its own spans when they end (the decode worker's Generate may end after the
        gateway's reply)."""
        ours = spans()[earlier:]
        transfer = next((s for s in ours if s["name"] == "prefill.transfer"), None)
        if transfer is None:
            return {}
        trace_id = transfer["context"]["trace_id"]
        return {s["name"]: s for s in ours if s["context"]["trace_id"] == trace_id}

    wait_for(lambda: set(hops) <= set(last_trace()), 10, "every hop's span exported")
    chain = last_trace()
    for parent, child in zip(hops, hops[1:], strict=False):
        assert chain[child]["parent_id"] == chain[parent]["context"]["span_id"], (parent, child)
    services = {chain[h]["resource"]["attributes"]["service.name"] for h in hops}
    assert services == {"kvmesh-gateway", "kvmesh-decode", "kvmesh-prefill"}
    assert chain["prefill.transfer"]["attributes"]["bytes"] > 0
