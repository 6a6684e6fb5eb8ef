"""Process lifecycle: stop signals become one orderly StopSignal, children die with their parent
(PR_SET_PDEATHSIG) and are stopped group-wide, the supervisor restarts with bounded backoff."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmesh.mesh.launcher import Mesh, UpOptions
from kvmesh.mesh.supervisor import RestartPolicy, Supervisor
from kvmesh.processes import StopSignal, StopSignals, spawn, stop_groups

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Running, not a zombie (a reparented child nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def signals():
    guard = StopSignals()
    guard.install()
    try:
        yield guard
    finally:
        guard.restore()


def test_a_signal_in_a_deferred_block_is_raised_at_its_end_and_only_once(signals):
    reached_end_of_block = False
    with pytest.raises(StopSignal) as raised, signals.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        reached_end_of_block = True
    assert reached_end_of_block and raised.value.signum == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping: counted, not raised
    os.kill(os.getpid(), signal.SIGHUP)
    assert signals.ignored == 2


def test_a_signal_is_raised_where_the_main_thread_is(signals):
    with pytest.raises(StopSignal) as raised:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(5)  # interrupted at once
    assert raised.value.signum == signal.SIGHUP


def test_disarmed_signals_never_interrupt_a_stop(signals):
    signals.disarm()
    os.kill(os.getpid(), signal.SIGINT)
    assert signals.ignored == 1 and signals.received is None


def test_a_child_dies_with_its_parent_even_when_the_parent_is_sigkilled():
    parent_code = textwrap.dedent(
        """
        import sys, time
        from kvmesh.processes import spawn
        child = spawn(["sleep", "60"], sys.stderr.buffer)
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        assert _until(lambda: not _alive(child), 5), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(10)
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_stop_groups_escalates_to_sigkill_for_the_whole_group(tmp_path):
    script = 'trap "" TERM; sleep 60 & echo $!; wait'  # ignores SIGTERM, and so does its sleep
    with (tmp_path / "log").open("wb") as log:
        proc = spawn(["sh", "-c", script], log)
    assert _until(lambda: (tmp_path / "log").read_text().strip() != "", 5)
    grandchild = int((tmp_path / "log").read_text())
    started = time.monotonic()
    stop_groups([proc], grace=0.3)
    assert proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5
    assert _until(lambda: not _alive(grandchild), 5)


def _supervisor(tmp_path, lines, **policy) -> Supervisor:
    return Supervisor(os.environ, lines.append, RestartPolicy(**policy), critical=frozenset({"gw"}))


def test_a_dying_child_is_restarted_with_backoff_then_given_up(tmp_path):
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, lines, max_restarts=2, backoff_s=0.05)
    supervisor.spawn("flaky", ["sh", "-c", "exit 3"], tmp_path / "flaky.log")
    first_pid = supervisor.pids()["flaky"]
    flaky = supervisor.children["flaky"]
    assert _until(lambda: supervisor.check() is None and flaky.given_up, 10)
    died = f"kvmesh: flaky exited (exit code 3; log: {tmp_path / 'flaky.log'})"
    assert [re.sub(r"pid \d+", "pid N", line) for line in lines] == [
        f"{died}; restarting it in 0.05s (1/2)",
        "kvmesh: flaky restarted (pid N)",
        f"{died}; restarting it in 0.1s (2/2)",
        "kvmesh: flaky restarted (pid N)",
        f"{died}; restarted 2 times already, giving up on it",
    ]
    assert supervisor.pids()["flaky"] != first_pid and flaky.restarts == 2


def test_the_new_pid_is_recorded_before_the_restart_is_said(tmp_path):
    recorded: dict[str, int] = {}
    said: list[tuple[str, dict[str, int]]] = []
    supervisor = Supervisor(
        os.environ,
        lambda line: said.append((line, dict(recorded))),
        RestartPolicy(max_restarts=1, backoff_s=0.01),
        on_change=lambda: recorded.update(supervisor.pids()),
    )
    supervisor.spawn("w", ["sh", "-c", "exit 1"], tmp_path / "w.log")
    assert _until(lambda: supervisor.check() is None and supervisor.children["w"].given_up, 10)
    line, seen = next((line, seen) for line, seen in said if "restarted (pid" in line)
    assert line == f"kvmesh: w restarted (pid {seen['w']})"  # the state named it already


def test_a_critical_child_that_dies_is_handed_back_not_restarted(tmp_path):
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, lines, backoff_s=0.01)
    supervisor.spawn("gw", ["sh", "-c", "kill -9 $$"], tmp_path / "gw.log")
    supervisor.spawn("worker", ["sleep", "60"], tmp_path / "worker.log")
    try:
        assert _until(lambda: supervisor.children["gw"].proc.poll() is not None, 5)
        lost = supervisor.check()
        assert lost is not None and lost.name == "gw" and lines == []
        assert lost.exited() == f"gw exited (killed by SIGKILL; log: {tmp_path / 'gw.log'})"
    finally:
        supervisor.stop(grace=2)
    assert supervisor.children["worker"].proc.returncode == -signal.SIGTERM


def test_the_mesh_stops_when_the_gateway_dies_and_stop_is_idempotent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    mesh = Mesh(UpOptions(), run_dir=tmp_path)
    mesh.supervisor.spawn("decode-0", ["sleep", "60"], tmp_path / "decode-0.log")
    mesh.supervisor.spawn("gateway", ["sh", "-c", "sleep 0.2; exit 1"], tmp_path / "gateway.log")
    try:
        assert mesh.wait() == 1
    finally:
        mesh.stop()
        mesh.stop()
    assert mesh.procs["decode-0"].returncode == -signal.SIGTERM
    log = tmp_path / "gateway.log"
    assert (
        f"kvmesh: gateway exited (exit code 1; log: {log}); stopping the mesh"
        in capsys.readouterr().out
    )
