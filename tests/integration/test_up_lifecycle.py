"""`kvmesh up` watched from its first instant: the first 200 of /health is followed at once by a
successful chat (1+1 and 2+2 meshes); a SIGTERM while starting or running, or a SIGKILL of the
launcher, leaves no process behind; a killed KV store is restarted while chat keeps working.
Each module fixture's last test stops its mesh."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from kvmesh.mesh.launcher import list_workers
from tests.integration.up_process import (
    ReadinessProbe,
    UpRun,
    alive,
    chat,
    descendants,
    grpc_health,
    marked,
    text_of,
    until,
)

pytestmark = pytest.mark.timeout(600)
READY_S = 240.0
SERVING = health_pb2.HealthCheckResponse.SERVING
CHEAP = ("--kv-cache-mib", "48", "--max-num-seqs", "4")
NO_STORE = ("--kvstore", "none")
SMALL_STORE = ("--kvstore", "builtin", "--kvstore-ram-mib", "32", "--kvstore-disk-mib", "64")


def _ready_run(tmp: Path, *args: str) -> Iterator[tuple[UpRun, ReadinessProbe]]:
    run = UpRun.start(tmp, *args)
    probe = ReadinessProbe(run.http_port, run.grpc_port)
    try:
        probe.start(READY_S)
        probe.done.wait(READY_S + 150)  # + the one chat request
        yield run, probe
    finally:
        run.close()


@pytest.fixture(scope="module")
def mesh_1x1(tmp_path_factory) -> Iterator[tuple[UpRun, ReadinessProbe]]:
    tmp = tmp_path_factory.mktemp("up1x1")
    yield from _ready_run(
        tmp, "--prefill", "1", "--decode", "1", "--decode-lead-cpu", "auto", *SMALL_STORE, *CHEAP
    )


@pytest.fixture(scope="module")
def mesh_2x2(tmp_path_factory) -> Iterator[tuple[UpRun, ReadinessProbe]]:
    yield from _ready_run(
        tmp_path_factory.mktemp("up2x2"), "--prefill", "2", "--decode", "2", *NO_STORE, *CHEAP
    )


def _assert_honest_readiness(run: UpRun, probe: ReadinessProbe) -> None:
    assert probe.chat is not None, f"/health never answered 200:\n{run.output()}"
    status, body = probe.chat
    assert status == 200, body  # the request sent the instant /health first said 200
    assert body["choices"][0]["message"]["content"]
    *before, ready = probe.probes
    assert ready.status == 200
    for answer in before:  # not listening yet, or 503 with an OpenAI error saying why
        assert answer.status in (0, 503), answer
        if answer.status == 503:
            assert set(answer.body["error"]) == {"message", "type", "param", "code"}
            assert "decode worker" in answer.body["error"]["message"]
    for answer in before[:-1]:  # (the last may race a worker registering between the two)
        assert answer.grpc != SERVING, "gRPC health said SERVING while /health was still 503"
    assert until(lambda: grpc_health(run.grpc_port) == SERVING, 5)
    assert until(lambda: run.said("kvmesh is up"), 60), run.output()


def _stop_and_check(run: UpRun, sig: int) -> set[int]:
    """Send `sig` to the launcher; within 10 s nothing it started may be left. Returns the
    processes below the launcher just before the signal."""
    before = descendants(run.proc.pid)
    assert before <= marked(run.home), "the environment marker misses some children"
    run.proc.send_signal(sig)

    def left() -> set[int]:  # an exiting process loses its environment before it is a zombie
        return marked(run.home) | {pid for pid in before if alive(pid)}

    gone = until(lambda: not left() and run.proc.poll() is not None, 10)
    still = {pid: _cmdline(pid) for pid in left()}
    assert gone, f"still running 10 s after {signal.Signals(sig).name}: {still}\n{run.output()}"
    return before


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def test_1x1_first_ready_answer_is_followed_at_once_by_a_successful_chat(mesh_1x1):
    _assert_honest_readiness(*mesh_1x1)


def test_labelled_counters_exist_at_zero_from_the_start(mesh_1x1):
    run, _ = mesh_1x1
    workers = asyncio.run(list_workers(run.state()["etcd"], "default"))
    decode = next(w for w in workers if w.role == "decode")
    text = text_of(f"http://{decode.metrics_address}/metrics")
    assert 'kvmesh_kv_integrity_failures_total{service="decode"} 0.0' in text
    assert 'kvmesh_faults_injected_total{kind="reassign",service="decode"} 0.0' in text
    gateway = text_of(f"http://127.0.0.1:{run.http_port}/metrics")
    assert 'kvmesh_requests_total{outcome="server_error",service="gateway"} 0.0' in gateway


def _store_address(run: UpRun) -> str | None:
    workers = asyncio.run(list_workers(run.state()["etcd"], "default"))
    stores = [w.grpc_address for w in workers if w.role == "kvstore"]
    return stores[0] if len(stores) == 1 else None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a lead CPU needs 2 CPUs")
def test_the_lone_decode_workers_engine_thread_keeps_the_last_cpu_to_itself(mesh_1x1):
    """--decode-lead-cpu auto: the decode worker's engine thread runs on the last CPU alone and
    its OpenMP team off it (both have decoded); every gateway thread runs off it."""
    run, _ = mesh_1x1
    lead = max(os.sched_getaffinity(0))
    decode: list[tuple[set[int], int]] = []  # (CPUs, CPU ticks) of each decode worker thread
    for pid in descendants(run.proc.pid):
        name = _cmdline(pid)
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                cpus = os.sched_getaffinity(int(task.name))
                ticks = sum(map(int, (task / "stat").read_text().rsplit(")", 1)[1].split()[11:13]))
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
            if "serve gateway" in name:
                assert lead not in cpus, f"gateway thread {task.name} may run on CPU {lead}"
            elif "serve decode" in name:
                decode.append((cpus, ticks))
    alone = [ticks for cpus, ticks in decode if cpus == {lead}]
    team = [ticks for cpus, ticks in decode if lead not in cpus]
    assert len(alone) == 1 and alone[0] > 0, decode  # the engine thread
    assert team and max(team) > 0, decode  # its team's other thread(s) decoded too


def test_a_killed_kvstore_is_restarted_and_chat_keeps_working(mesh_1x1):
    run, _ = mesh_1x1
    old_pid, old_address = run.state()["pids"]["kvstore"], _store_address(run)
    os.killpg(old_pid, signal.SIGKILL)
    assert until(lambda: not alive(old_pid), 5)
    assert chat(run.http_port)[0] == 200  # a dead store only costs cache misses
    restarted = until(lambda: run.said("kvmesh: kvstore restarted"), 30)
    assert restarted, run.output()
    report = run.said("kvmesh: kvstore exited")
    assert "killed by SIGKILL" in report and "restarting it in 1s (1/3)" in report
    assert str(Path(run.state()["logs"]) / "kvstore.log") in report
    new_pid = run.state()["pids"]["kvstore"]
    assert new_pid != old_pid and alive(new_pid) and f"pid {new_pid}" in restarted
    new_address = until(lambda: (a := _store_address(run)) != old_address and a, 30)
    assert new_address, "the restarted store never registered"
    decode_log = Path(run.state()["logs"]) / "decode-0.log"
    assert until(lambda: new_address in decode_log.read_text(), 15), "decode kept the old store"
    assert chat(run.http_port)[0] == 200
    assert run.proc.poll() is None, "the mesh stopped over a KV store"


def test_a_killed_worker_is_restarted_and_registers_again(mesh_1x1):
    run, _ = mesh_1x1
    old_pid = run.state()["pids"]["prefill-0"]
    os.killpg(old_pid, signal.SIGKILL)
    assert chat(run.http_port)[0] == 200  # decode prefills itself meanwhile (or retries)
    restarted = until(lambda: run.said("kvmesh: prefill-0 restarted"), 30)
    assert restarted and "killed by SIGKILL" in run.said("kvmesh: prefill-0 exited")
    new_pid = run.state()["pids"]["prefill-0"]
    assert new_pid != old_pid and f"pid {new_pid}" in restarted

    def registered_again() -> bool:  # its log is appended to: a second "worker.ready"
        return (Path(run.state()["logs"]) / "prefill-0.log").read_text().count("worker.ready") == 2

    assert until(registered_again, 120, period=0.5), run.output()
    assert chat(run.http_port)[0] == 200
    assert run.proc.poll() is None, "the mesh stopped over a worker"


def test_sigterm_when_running_leaves_no_process(mesh_1x1):
    run, _ = mesh_1x1
    before = _stop_and_check(run, signal.SIGTERM)
    assert len(before) >= 5  # etcd, kvstore, prefill, decode, gateway
    assert run.proc.returncode == 0
    assert run.said("kvmesh: stopped"), run.output()


def test_2x2_first_ready_answer_is_followed_at_once_by_a_successful_chat(mesh_2x2):
    _assert_honest_readiness(*mesh_2x2)


def test_sigkill_of_the_launcher_leaves_no_process(mesh_2x2):
    run, _ = mesh_2x2
    before = _stop_and_check(run, signal.SIGKILL)  # the children go by PR_SET_PDEATHSIG
    assert len(before) >= 6  # etcd, gateway, 2 prefill, 2 decode


@pytest.mark.parametrize("after_s", [1, 5])
def test_sigterm_while_starting_leaves_no_process(tmp_path, after_s):
    run = UpRun.start(tmp_path, "--prefill", "1", "--decode", "1", *NO_STORE, *CHEAP)
    try:
        time.sleep(after_s)  # the point of the test: a signal at this moment of start-up
        before = _stop_and_check(run, signal.SIGTERM)
        if after_s == 5:  # by then etcd runs (and, unless the host is slow, the workers start)
            assert before and run.proc.returncode == 0
            assert run.said("kvmesh: SIGTERM received, stopping everything")
            assert run.said("kvmesh: stopped"), run.output()
        else:  # maybe before its handlers were installed: then nothing was started either
            assert run.proc.returncode in (0, -signal.SIGTERM)
    finally:
        run.close()
