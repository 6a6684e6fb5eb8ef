"""A mesh across hosts: network namespaces joined by a bridge on a private /24 (made and removed
by the test) stand for the hosts "gateway", "prefill", "decode-a", "decode-b" and "store" (etcd +
KV store); every service binds and advertises its host's address (gRPC, metrics, the transfer
engine). Greedy answers equal the single-process engine, KV pages cross hosts through the
transfer engine, a repeated prompt hits the cache across hosts, and killing one decode host's
worker in the middle of streams is survived (migration). One decode host binds 0.0.0.0 and
advertises its address (--advertise-host), as in a pod. Skipped without root or `ip netns`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.etcd_server import etcd_binary
from kvmesh.processes import spawn, terminate_group
from tests.integration.hosts import Hosts, simulated_hosts, unavailable

pytestmark = pytest.mark.timeout(900)
if (WHY := unavailable()) is not None:
    pytest.skip(WHY, allow_module_level=True)

MODEL = "smollm2-135m"
ETCD_PORT, GRPC_PORT, METRICS_PORT, HTTP_PORT = 41379, 41051, 41400, 41800
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6
QUESTIONS = [
    "Name a planet.",
    "What is two plus two?",
    "Name a colour of the sky.",
    "Say hello in French.",
]
# Runs on the gateway's host: the questions streamed concurrently; JSON lines out.
CLIENT = """
import concurrent.futures, json, sys, openai
url, questions, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
def ask(q):
    stream = client.chat.completions.create(model="smollm2-135m", max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": sys.argv[5] == "1"},
        messages=[{"role": "system", "content": sys.argv[4]}, {"role": "user", "content": q}])
    text, cached = "", 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return [text, cached]
with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
    print(json.dumps(list(pool.map(ask, questions))))
"""
PROBE = (
    "import sys; from kvmesh_apps.deploy.probe import ready; "
    "sys.exit(0 if ready(sys.argv[1], int(sys.argv[2]), sys.argv[3]) else 1)"
)
METRIC = (
    "import sys; from kvmesh.mesh.metrics_probe import metric_sum; "
    "print(metric_sum(sys.argv[1], sys.argv[2]))"
)


class HostMesh:
    def __init__(self, hosts: Hosts, run_dir: str) -> None:
        self.hosts, self.run_dir = hosts, run_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, host: str, argv: list[str]) -> None:
        env = {
            **os.environ,
            "MC_TCP_BIND_ADDRESS": self.hosts.addresses[host],
            "KVMESH_NUM_THREADS": "1",
        }
        log = open(os.path.join(self.run_dir, f"{name}.log"), "ab")  # noqa: SIM115
        self.procs[name] = spawn(self.hosts.command(host, argv), log, env=env)

    def serve(
        self,
        role: str,
        host: str,
        *flags: str,
        name: str | None = None,
        every_interface: bool = False,
    ) -> None:
        """`every_interface`: bind 0.0.0.0 and advertise the host's address (as in a pod)."""
        etcd, address = f"{self.hosts.addresses['store']}:{ETCD_PORT}", self.hosts.addresses[host]
        where = (
            ["--host", "0.0.0.0", "--advertise-host", address]
            if every_interface
            else ["--host", address]
        )
        self.start(
            name or role,
            host,
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "serve",
                role,
                "--etcd",
                etcd,
                *where,
                "--model",
                MODEL,
                *flags,
            ],
        )

    def run(self, host: str, code: str, *args: str, timeout: float = 600) -> str:
        """Python `code` run on `host`; its stdout (AssertionError with the output if it fails)."""
        done = subprocess.run(
            self.hosts.command(host, [sys.executable, "-c", code, *args]),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    def ready(self, host: str, kind: str, address: str, port: int) -> bool:
        probe = self.hosts.command(host, [sys.executable, "-c", PROBE, kind, str(port), address])
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0

    def wait(
        self, what: str, host: str, kind: str, address: str, port: int, limit_s: float = 300
    ) -> None:
        deadline = time.monotonic() + limit_s
        while not self.ready(host, kind, address, port):
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"exited while waiting for {what}: {dead}\n{self.logs()}"
            assert time.monotonic() < deadline, f"{what} not ready in {limit_s} s\n{self.logs()}"
            time.sleep(1)

    def metric(self, host: str, port: int, name: str) -> float:
        address = f"{self.hosts.addresses[host]}:{port}"
        return float(self.run("gateway", METRIC, address, name, timeout=60))

    def logs(self) -> str:
        tails = []
        for name in self.procs:
            with contextlib.suppress(OSError):
                text = open(os.path.join(self.run_dir, f"{name}.log"), errors="replace").read()  # noqa: SIM115
                tails.append(f"--- {name}\n{text[-1500:]}")
        return "\n".join(tails)

    def stop(self) -> None:
        for proc in self.procs.values():
            terminate_group(proc, 10)


@pytest.fixture(scope="module")
def mesh() -> Iterator[HostMesh]:
    names = ["gateway", "prefill", "decode-a", "decode-b", "store"]
    with simulated_hosts(names) as hosts, tempfile.TemporaryDirectory() as run_dir:
        mesh = HostMesh(hosts, run_dir)
        store = hosts.addresses["store"]
        try:
            mesh.start(
                "etcd",
                "store",
                [
                    str(etcd_binary()),
                    "--name=hosts-etcd",
                    f"--data-dir={run_dir}/etcd",
                    f"--listen-client-urls=http://{store}:{ETCD_PORT}",
                    f"--advertise-client-urls=http://{store}:{ETCD_PORT}",
                    f"--listen-peer-urls=http://127.0.0.1:{ETCD_PORT + 1}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{ETCD_PORT + 1}",
                    f"--initial-cluster=hosts-etcd=http://127.0.0.1:{ETCD_PORT + 1}",
                    "--log-level=error",
                    "--unsafe-no-fsync",
                ],
            )
            mesh.wait("etcd", "store", "tcp", store, ETCD_PORT, 60)
            worker = ("--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT))
            mesh.serve("kvstore", "store", *worker)  # its page layout derived from --model
            mesh.serve("prefill", "prefill", *worker)
            for host in ("decode-a", "decode-b"):  # decode-b listens on every interface
                mesh.serve(
                    "decode",
                    host,
                    *worker,
                    "--worker-id",
                    host,
                    name=host,
                    every_interface=host == "decode-b",
                )
            mesh.serve("gateway", "gateway", "--http-port", str(HTTP_PORT))
            for host in ("store", "prefill", "decode-a", "decode-b"):
                mesh.wait(host, "gateway", "grpc", hosts.addresses[host], GRPC_PORT)
            mesh.wait("gateway", "gateway", "http", hosts.addresses["gateway"], HTTP_PORT)
            yield mesh
        finally:
            mesh.stop()
    for proc in mesh.procs.values():
        assert proc.poll() is not None, "a process outlived the test"


LONG = 96  # tokens per stream (ignore_eos) while a decode host dies


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, int], str]:
    llm = LLM(dtype="fp32", kv_cache_bytes=64 << 20)
    chats = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    short = llm.chat(chats, SamplingParams(max_tokens=40, temperature=0.0))
    long = llm.chat(chats, SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True))
    return {
        **{(q, 40): o.text for q, o in zip(QUESTIONS, short, strict=True)},
        **{(q, LONG): o.text for q, o in zip(QUESTIONS, long, strict=True)},
    }


def _client(mesh: HostMesh, max_tokens: int) -> list[str]:
    url = f"http://{mesh.hosts.addresses['gateway']}:{HTTP_PORT}/v1"
    return mesh.hosts.command(
        "gateway",
        [
            sys.executable,
            "-c",
            CLIENT,
            url,
            json.dumps(QUESTIONS),
            str(max_tokens),
            SYSTEM,
            "1" if max_tokens == LONG else "0",
        ],
    )


def _ask(mesh: HostMesh, max_tokens: int = 40) -> list[tuple[str, int]]:
    done = subprocess.run(_client(mesh, max_tokens), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(item) for item in json.loads(done.stdout)]


def test_answers_equal_the_engine_and_pages_cross_hosts(mesh, reference):
    answers = _ask(mesh)
    assert [text for text, _ in answers] == [reference[q, 40] for q in QUESTIONS]
    moved = mesh.metric("prefill", METRICS_PORT, "kvmesh_kv_transfer_bytes_total")
    assert moved > 0, "no KV page crossed from the prefill host to a decode host"
    again = _ask(mesh)  # the shared system prompt's pages are cached somewhere now
    assert [text for text, _ in again] == [reference[q, 40] for q in QUESTIONS]
    assert all(cached >= 16 for _, cached in again), again


def test_a_worker_bound_to_every_interface_is_registered_at_its_address(mesh):
    """decode-b listens on 0.0.0.0: etcd holds its host's address for every endpoint peers
    dial, and `kvmesh status` on another host reaches it there (GetLoads). Runs before the
    test below kills a decode host (the order of this file)."""
    etcd = f"{mesh.hosts.addresses['store']}:{ETCD_PORT}"
    argv = [sys.executable, "-m", "kvmesh.cli", "status", "--etcd", etcd, "--json"]
    done = subprocess.run(
        mesh.hosts.command("gateway", argv), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    worker = next(w for w in json.loads(done.stdout)["workers"] if w["id"] == "decode-b")
    address = mesh.hosts.addresses["decode-b"]
    for endpoint in ("grpc", "metrics", "te_session", "delivery"):
        assert worker[endpoint].rpartition(":")[0] == address, (endpoint, worker)
    assert worker["load"] is not None, worker


def test_losing_a_decode_host_mid_stream_is_survived(mesh, reference):
    def generated() -> dict[str, float]:
        return {
            h: mesh.metric(h, METRICS_PORT, "kvmesh_generation_tokens_total")
            for h in ("decode-a", "decode-b")
        }

    before = generated()
    client = subprocess.Popen(
        _client(mesh, LONG), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline, busy = time.monotonic() + 120, []
        while not busy:  # kill a decode host while streams are running on it
            assert time.monotonic() < deadline and client.poll() is None, mesh.logs()
            busy = [h for h, n in generated().items() if n - before[h] >= 8]
            time.sleep(0.2)
        victim = mesh.procs[busy[0]]
        os.killpg(victim.pid, signal.SIGKILL)  # the host's worker dies, no drain
        victim.wait(timeout=30)
        out, err = client.communicate(timeout=600)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, err[-3000:]
    assert [text for text, _ in json.loads(out)] == [reference[q, LONG] for q in QUESTIONS]
    migrated = mesh.metric("gateway", HTTP_PORT, "kvmesh_request_migrations_total")
    assert migrated >= 1, "no stream moved off the decode host that died"
