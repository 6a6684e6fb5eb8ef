"""Nothing lost under faults: a stream whose decode worker dies migrates to another and goes on
as if nothing happened (the openai client and the gRPC Gateway), a SIGTERMed worker drains, a
rolling restart of every worker under load fails no request. One mesh: etcd, gateway, KV store,
1 prefill + 2 decode workers; killed workers are restarted by the mesh's supervisor."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.launcher import UpOptions
from kvmesh.mesh.supervisor import RestartPolicy
from kvmesh.mesh.up_config import worker_configs
from kvmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.chat_client import client_for
from tests.integration.mesh_probes import (
    live_workers,
    metric_sum,
    module_mesh,
    pages_in_use,
    samples,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)
MODEL = "smollm2-135m"
TOPICS = ["a lighthouse", "a fox", "the sea", "a clock", "a train", "rain", "a garden", "snow"]
MAX_TOKENS = 48
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh():
    options = UpOptions(
        workers=worker_configs("--kv-cache-mib", "96", "--max-num-seqs", "16"), prefill=1, decode=2
    )
    with module_mesh(options) as running:
        # workers die here many times over: restart each at once, every time
        running.supervisor.policy = RestartPolicy(max_restarts=100, backoff_s=0.1)
        yield running


@pytest.fixture(scope="module")
def client(mesh):
    return client_for(mesh)


@pytest.fixture(scope="module")
def reference():
    with LLM(dtype="fp32", kv_cache_bytes=96 << 20) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(reference):
    """Each topic's greedy story from the single-process engine."""
    outs = reference.chat([_ask(topic) for topic in TOPICS], GREEDY)
    return {topic: out.text for topic, out in zip(TOPICS, outs, strict=True)}


def _ask(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me a story about {topic}."}]


def _stream(client, topic: str, progress: threading.Semaphore | None = None) -> str:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_ask(topic),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = []
    for i, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if i == 3 and progress is not None:
            progress.release()
    return "".join(text)


def _busiest_decode(mesh):
    decodes = live_workers(mesh, "decode")
    return max(decodes, key=lambda w: metric_sum(w.metrics_address, "kvmesh_kv_pages_used"))


def _restarted(mesh, role: str, count: int) -> None:
    """Let the supervisor restart what died; wait until `count` `role` workers, each of the
    process now running under its name, are registered (a dead one's key outlives it until
    its lease expires)."""

    def back() -> bool:
        mesh.supervisor.check()
        procs = mesh.procs
        current = [
            w
            for w in live_workers(mesh, role)
            if procs[w.worker_id].poll() is None
            and json.loads(w.extra["ranks"])[0]["pid"] == procs[w.worker_id].pid
        ]
        return len(current) == count

    wait_for(back, 180, f"{count} {role} workers registered again")


def _migrations(mesh, outcome: str) -> float:
    found = samples(f"127.0.0.1:{mesh.http_port}", "kvmesh_request_migrations_total")
    return sum(v for labels, v in found.items() if dict(labels).get("outcome") == outcome)


def test_killing_a_decode_worker_mid_stream_migrates_every_stream(client, mesh, expected):
    before = _migrations(mesh, "migrated")
    progress = threading.Semaphore(0)
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        futures = {t: pool.submit(_stream, client, t, progress) for t in TOPICS}
        for _ in TOPICS:  # every stream has its first chunks
            assert progress.acquire(timeout=120)
        victim = _busiest_decode(mesh)
        proc = mesh.procs[victim.worker_id]
        os.kill(proc.pid, signal.SIGKILL)
        texts = {topic: future.result(timeout=300) for topic, future in futures.items()}
    assert texts == expected  # no error, no repeat, no gap: as if the worker had lived
    assert _migrations(mesh, "migrated") > before
    proc.wait(10)
    _restarted(mesh, "decode", 2)
    wait_for(lambda: pages_in_use(mesh) == 0, 60, "pages held after the migrated streams")


def test_grpc_gateway_stream_migrates_too(mesh, reference):
    ids = reference.tokenizer.encode_chat(_ask(TOPICS[0]))
    want = reference.generate_ids([ids], GREEDY)[0].token_ids
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    got: list[int] = []
    before = _migrations(mesh, "migrated")
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for i, reply in enumerate(stub.Generate(request, timeout=300)):
            got.extend(reply.token_ids)
            if i == 3:
                proc = mesh.procs[_busiest_decode(mesh).worker_id]
                os.kill(proc.pid, signal.SIGKILL)
    assert got == want
    assert _migrations(mesh, "migrated") == before + 1
    proc.wait(10)
    _restarted(mesh, "decode", 2)


def test_with_every_decode_worker_dead_the_stream_ends_with_a_clear_error(client, mesh):
    import openai

    progress = threading.Semaphore(0)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_stream, client, TOPICS[1], progress)
        assert progress.acquire(timeout=120)
        victims = [mesh.procs[w.worker_id] for w in live_workers(mesh, "decode")]
        for proc in victims:
            os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="decode"):
            future.result(timeout=60)
    for proc in victims:
        proc.wait(10)
    _restarted(mesh, "decode", 2)
    reply = client.chat.completions.create(model=MODEL, messages=_ask("tea"), max_tokens=4)
    assert reply.choices[0].message.content
    wait_for(lambda: pages_in_use(mesh) == 0, 60, "pages held after the failed stream")


def test_sigterm_drains_a_decode_worker_its_streams_finish_there(client, mesh, expected):
    """SIGTERM: the lease goes at once (no new requests), the streams it serves finish on it
    (no migration), then it exits 0."""
    before = _migrations(mesh, "migrated")
    progress = threading.Semaphore(0)
    topics = TOPICS[:4]
    with ThreadPoolExecutor(len(topics)) as pool:
        futures = {t: pool.submit(_stream, client, t, progress) for t in topics}
        for _ in topics:
            assert progress.acquire(timeout=120)
        victim = _busiest_decode(mesh)
        proc = mesh.procs[victim.worker_id]
        os.kill(proc.pid, signal.SIGTERM)
        gone = lambda: victim.worker_id not in {w.worker_id for w in live_workers(mesh, "decode")}  # noqa: E731
        wait_for(gone, 5, "the draining worker's lease revoked")
        texts = {topic: future.result(timeout=300) for topic, future in futures.items()}
    assert texts == {t: expected[t] for t in topics}
    assert proc.wait(60) == 0
    assert _migrations(mesh, "migrated") == before  # each finished where it ran
    _restarted(mesh, "decode", 2)


def test_rolling_restart_of_every_worker_under_load_fails_no_request(client, mesh, expected):
    stop = threading.Event()
    done: list[tuple[str, str]] = []
    failed: list[str] = []

    def load(offset: int) -> None:
        for i in itertools.count(offset):
            if stop.is_set():
                return
            topic = TOPICS[i % len(TOPICS)]
            try:
                done.append((topic, _stream(client, topic)))
            except Exception as exc:  # noqa: BLE001 - any failure is what this test counts
                failed.append(repr(exc))

    with ThreadPoolExecutor(4) as pool:
        loops = [pool.submit(load, k) for k in range(4)]
        for name, role, count in (
            ("decode-0", "decode", 2),
            ("prefill-0", "prefill", 1),
            ("decode-1", "decode", 2),
        ):
            base = len(done)
            wait_for(lambda: len(done) >= base + 2, 120, "requests completing between restarts")  # noqa: B023
            proc = mesh.procs[name]
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(60) == 0, f"{name} did not drain and exit cleanly"
            _restarted(mesh, role, count)
        stop.set()
        for loop in loops:
            loop.result(timeout=300)
    assert failed == []
    assert len(done) >= 6
    assert all(text == expected[topic] for topic, text in done)
    wait_for(lambda: pages_in_use(mesh) == 0, 60, "pages held after the rolling restart")
