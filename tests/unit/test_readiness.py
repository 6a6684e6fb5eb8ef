"""Gateway readiness: /health is 503 with a reason until a chat request would succeed, gRPC health
follows it, /live is liveness only; labelled metrics exist at 0 from process start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.testclient import TestClient

from kvmesh.engine.core.faults import KINDS
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.grpc_server import start_server
from services.gateway.openai_api import create_app
from services.gateway.readiness import MeshReadiness, follow
from tests.unit.fake_backend import FakeBackend

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _worker(role: str, index: int, kv_dtype: str = "fp32") -> WorkerInfo:
    return WorkerInfo(
        role=role,
        worker_id=f"{role}-{index}",
        grpc_address=f"127.0.0.1:{9000 + index}",
        model="smollm2-135m",
        page_size=16,
        kv_dtype=kv_dtype,
    )


class Live:
    """What the gateway's etcd watch would see; tests add and remove workers."""

    def __init__(self) -> None:
        self.workers: list[WorkerInfo] = []

    def __call__(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role == role]


@pytest.fixture
def live() -> Live:
    return Live()


@pytest.fixture
def client(live: Live) -> Iterator[TestClient]:
    tokenizer = Tokenizer.from_source(resolve_model("smollm2-135m"))
    app = create_app(FakeBackend(tokenizer), tokenizer, readiness=MeshReadiness(live))
    with TestClient(app) as test_client:
        yield test_client


def _not_ready_reason(client: TestClient) -> str:
    response = client.get("/health")
    assert response.status_code == 503
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "server_error"
    assert body["error"]["code"] == "worker_unavailable"
    return body["error"]["message"]


def test_health_is_503_with_a_reason_until_a_decode_worker_is_live(client, live):
    assert "no live decode worker" in _not_ready_reason(client)
    live.workers.append(_worker("prefill", 0))
    assert "1 prefill worker(s) registered" in _not_ready_reason(client)
    assert client.get("/live").json() == {"status": "ok"}  # liveness never waits for workers
    live.workers.append(_worker("decode", 0))
    response = client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_a_decode_worker_alone_is_ready_it_prefills_itself(client, live):
    live.workers += [_worker("decode", 0), _worker("prefill", 1, kv_dtype="bf16")]
    assert client.get("/health").status_code == 200
    state = MeshReadiness(live).check()
    assert state.ready and "decode workers themselves" in state.reason  # the bf16 one can't pair
    live.workers.append(_worker("prefill", 2))
    assert "1 prefill worker(s)" in MeshReadiness(live).check().reason


def test_health_goes_back_to_503_when_the_decode_workers_vanish(client, live):
    live.workers.append(_worker("decode", 0))
    assert client.get("/health").status_code == 200
    live.workers.clear()
    assert "decode workers are gone" in _not_ready_reason(client)


async def _grpc_statuses(live: Live) -> list[int]:
    """The server-wide gRPC health status: before any worker, with one, after it left."""
    server, port, health = await start_server([], "127.0.0.1", 0, serving=False)
    follower = asyncio.create_task(follow(MeshReadiness(live), health, period_s=0.02))
    seen: list[int] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for change in (
                lambda: None,
                lambda: live.workers.append(_worker("decode", 0)),
                live.workers.clear,
            ):
                change()
                want = SERVING if live("decode") else NOT_SERVING
                for _ in range(200):  # until `follow` caught up (it polls every 20 ms)
                    status = (await stub.Check(health_pb2.HealthCheckRequest())).status
                    if status == want:
                        break
                    await asyncio.sleep(0.01)
                seen.append(status)
    finally:
        follower.cancel()
        await server.stop(None)
    return seen


def test_grpc_health_follows_readiness(live):
    assert asyncio.run(_grpc_statuses(live)) == [NOT_SERVING, SERVING, NOT_SERVING]


def _series(text: str, name: str) -> dict[str, float]:
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


_INIT_AND_SCRAPE = """
import sys
from prometheus_client import generate_latest
from kvmesh.mesh import metrics
metrics.init_series("decode", fault_kinds=sys.argv[1:])
metrics.init_series("gateway")
print(generate_latest().decode())
"""


def test_labelled_counters_exist_at_zero_after_init():
    # A fresh process: the registry is process-wide, and other tests here increment it.
    text = subprocess.run(
        [sys.executable, "-c", _INIT_AND_SCRAPE, *KINDS],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    integrity = _series(text, "kvmesh_kv_integrity_failures_total")
    assert integrity['kvmesh_kv_integrity_failures_total{service="decode"}'] == 0
    faults = _series(text, "kvmesh_faults_injected_total")
    for kind in KINDS:
        assert faults[f'kvmesh_faults_injected_total{{kind="{kind}",service="decode"}}'] == 0
    requests = _series(text, "kvmesh_requests_total")
    assert requests['kvmesh_requests_total{outcome="server_error",service="gateway"}'] == 0
    routing = _series(text, "kvmesh_routing_decisions_total")
    assert routing['kvmesh_routing_decisions_total{reason="affinity",role="decode"}'] == 0
