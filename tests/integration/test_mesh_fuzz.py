"""Fuzzing a live mesh (a short run; `kvmesh bench fuzz` runs thousands): schemathesis requests
from the gateway's own /openapi.json get no 5xx, no hang and documented shapes; protobuf
messages hypothesis builds for every method of the gateway, decode, prefill and KV store
services end no call with UNKNOWN (an unhandled exception); afterwards the mesh still answers
exactly and holds no page."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import gateway_config, worker_configs
from kvmesh.proto.v1 import decode_pb2, gateway_pb2, kvstore_pb2, prefill_pb2
from kvmesh_apps.benchmarks.fuzz import fuzz_grpc, fuzz_rest
from kvmesh_apps.benchmarks.fuzz_edges import fuzz_edges
from tests.integration.mesh_probes import module_mesh, pages_in_use, wait_for

pytestmark = pytest.mark.timeout(900)
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def mesh():
    options = UpOptions(
        workers=worker_configs("--kv-cache-mib", "64"),
        prefill=1,
        decode=1,
        kvstore="builtin",
        gateway=gateway_config("--max-output-tokens", "4", "--max-prompt-tokens", "256"),
    )
    with module_mesh(options) as running:
        yield running


def test_generated_rest_requests_get_documented_answers(mesh):
    report = fuzz_rest(f"http://127.0.0.1:{mesh.http_port}", examples=12)
    assert report.requests >= 50  # hypothesis stops early once an operation's space is covered
    assert report.failures == [], report.failures[:5]
    assert not [status for status in report.outcomes if status >= 500], report.outcomes
    assert report.outcomes[200] > 0 and report.outcomes[400] > 0  # both kinds were tried


def test_generated_grpc_messages_crash_no_service(mesh):
    workers = {w.role: w for w in asyncio.run(list_workers(mesh.etcd.endpoint, "default"))}
    targets = [
        (f"127.0.0.1:{mesh.grpc_port}", gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]),
        (workers["decode"].grpc_address, decode_pb2.DESCRIPTOR.services_by_name["Decode"]),
        (workers["prefill"].grpc_address, prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]),
        (workers["kvstore"].grpc_address, kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]),
    ]
    report = fuzz_grpc(targets, examples=12)
    assert report.requests >= 100  # a method without fields is tried once
    assert report.failures == [], report.failures[:5]
    assert "INVALID_ARGUMENT" in report.outcomes and "OK" in report.outcomes


def test_hostile_bodies_and_pydantic_tool_schemas_get_no_5xx(mesh):
    """Nesting thousands deep, NaN / Infinity / 1e308 in numeric fields, pydantic's schemas
    under forced and strict tool choices, on every endpoint (a sample; the bench runs all)."""
    report = fuzz_edges(f"http://127.0.0.1:{mesh.http_port}", MODEL, quick=True)
    assert report.failures == [], report.failures[:5]
    assert report.outcomes[400] > 0 and report.outcomes[200] > 0, report.outcomes


def test_the_mesh_still_answers_exactly_after_the_fuzzing(mesh):
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="x", max_retries=0, timeout=60
    )
    ask = [{"role": "user", "content": "Name a color."}]
    got = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0)
    with LLM(dtype="fp32", kv_cache_bytes=32 << 20) as llm:
        want = llm.chat(ask, SamplingParams(max_tokens=4, temperature=0.0))[0].text
    assert got.choices[0].message.content == want
    for proc in mesh.procs.values():
        assert proc.poll() is None, "a service died under fuzzing"
    wait_for(lambda: pages_in_use(mesh) == 0, 60, "pages held after the fuzzing")
