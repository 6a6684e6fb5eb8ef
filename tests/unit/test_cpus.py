"""CPU sets for workers: parsing and printing CPU lists, `--cpus` / `--<role>-cpus` exported to the
environment, a process pinned by KVMESH_CPUS with one torch thread per CPU, the launcher's
per-worker KVMESH_CPUS and the supervisor's per-child environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh import env
from kvmesh.cli_args import build_parser
from kvmesh.errors import LaunchError
from kvmesh.mesh.affinity import checked_cpus, decode_lead_cpu, format_cpus, worker_env
from kvmesh.mesh.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]
TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs CPUs 0 and 1")


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-1", {0, 1}), ("3,0-1", {0, 1, 3}), (" 2 , 4-5 ", {2, 4, 5})],
)
def test_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert env.parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-0", "0,", "-1", "0-", "1--2"])
def test_malformed_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        env.parse_cpus(text)


def test_cpu_lists_print_as_runs() -> None:
    assert format_cpus({5, 0, 1, 2}) == "0-2,5"
    assert format_cpus([7]) == "7"


def test_cpus_outside_this_process_are_a_launch_error() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(LaunchError, match=f"CPUs {missing} are not available"):
        checked_cpus(str(missing))


def test_serve_threads_follow_the_affinity_unless_set(monkeypatch) -> None:
    monkeypatch.delenv("KVMESH_NUM_THREADS", raising=False)
    assert env.serve_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("KVMESH_NUM_THREADS", "3")
    assert env.serve_threads() == 3


@TWO_CPUS
def test_cpus_flags_are_exported_to_the_environment(monkeypatch) -> None:
    for name in ("KVMESH_CPUS", "KVMESH_PREFILL_CPUS", "KVMESH_DECODE_CPUS"):
        monkeypatch.delenv(name, raising=False)
    argv = ["serve", "decode", "--etcd", "127.0.0.1:1", "--cpus", "1,0"]
    assert build_parser(argv).parse_args(argv).cpus == "0-1"
    assert env.worker_cpus() == "0-1"
    argv = ["up", "--prefill-cpus", "0", "--decode-cpus", "1"]
    args = build_parser(argv).parse_args(argv)
    assert (args.prefill_cpus, args.decode_cpus) == ("0", "1")
    assert (env.role_cpus("prefill"), env.role_cpus("decode")) == ("0", "1")


PROBE = """
import json, os, sys
from kvmesh.cli_args import build_parser
argv = ["serve", "prefill", "--etcd", "127.0.0.1:1", "--cpus", "0"]
build_parser(argv).parse_args(argv)
import torch  # loaded before the pinning, as in a worker
from kvmesh.mesh.affinity import apply_worker_cpus
placed = apply_worker_cpus()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(json.dumps({"cpus": sorted(placed.cpus), "threads": torch.get_num_threads(),
                  "all": [sorted(os.sched_getaffinity(t)) for t in tids]}))
"""


@TWO_CPUS
def test_a_worker_started_with_cpus_0_runs_on_cpu_0_with_one_torch_thread() -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("KVMESH_CPUS", "KVMESH_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=clean,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["cpus"] == [0] and result["threads"] == 1
    assert all(cpus == [0] for cpus in result["all"])


@TWO_CPUS
def test_the_launcher_gives_each_role_its_cpus(monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_DECODE_CPUS", "0-1")
    assert worker_env("prefill", "1") == {"KVMESH_CPUS": "1"}  # UpOptions.role_cpus first
    assert worker_env("decode") == {"KVMESH_CPUS": "0-1"}  # else KVMESH_<ROLE>_CPUS
    monkeypatch.delenv("KVMESH_DECODE_CPUS")
    assert worker_env("decode") == {}


def _worker_envs(monkeypatch, tmp_path: Path, cpus: int, **options) -> dict[str, dict]:
    from kvmesh.mesh.launcher import Mesh, UpOptions

    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    mesh = Mesh(UpOptions(**options), run_dir=tmp_path)
    spawned: dict[str, dict] = {}

    def spawn(name: str, args: list[str], extra=None, cpus=None) -> None:
        spawned[name] = extra if cpus is None else {**extra, "cpus": format_cpus(cpus)}

    monkeypatch.setattr(mesh, "_spawn", spawn)
    mesh._spawn_workers()
    return spawned


def test_unpinned_prefill_workers_on_a_crowded_machine_serve_on_one_thread(monkeypatch, tmp_path):
    """Two OpenMP teams on the same two cores stall each other: prefill gets one thread there,
    one decode worker keeps one per CPU, several share them; a roomy machine,
    KVMESH_NUM_THREADS or pinning leave both alone."""
    for name in ("KVMESH_NUM_THREADS", "KVMESH_PREFILL_CPUS", "KVMESH_DECODE_CPUS"):
        monkeypatch.delenv(name, raising=False)
    crowded = _worker_envs(monkeypatch, tmp_path, 2, decode_lead_cpu="off")
    assert crowded == {"prefill-0": {"KVMESH_NUM_THREADS": "1"}, "decode-0": {}}
    roomy = _worker_envs(monkeypatch, tmp_path, 8, decode_lead_cpu="off")
    assert roomy == {"prefill-0": {}, "decode-0": {}}
    two = _worker_envs(monkeypatch, tmp_path, 2, prefill=2, decode=2)
    assert {name: env["KVMESH_NUM_THREADS"] for name, env in two.items()} == {
        "prefill-0": "1",
        "prefill-1": "1",
        "decode-0": "1",
        "decode-1": "1",
    }
    assert _worker_envs(monkeypatch, tmp_path, 4, prefill=2, decode=2)["decode-0"] == {
        "KVMESH_NUM_THREADS": "2"
    }
    pinned = _worker_envs(monkeypatch, tmp_path, 2, role_cpus={"prefill": "0"})
    assert pinned["prefill-0"] == {"KVMESH_CPUS": "0"}
    monkeypatch.setenv("KVMESH_NUM_THREADS", "2")
    assert _worker_envs(monkeypatch, tmp_path, 2)["prefill-0"] == {}


@TWO_CPUS
def test_a_lone_decode_worker_gets_the_last_cpu_for_its_engine_thread(monkeypatch, tmp_path):
    """auto (the default): one decode worker, no role placed by the user, 2+ CPUs; its engine
    thread takes the last CPU (KVMESH_LEAD_CPU); the worker starts wherever (its engine thread
    moves its team), the gateway on the rest."""
    for name in ("KVMESH_NUM_THREADS", "KVMESH_PREFILL_CPUS", "KVMESH_DECODE_CPUS"):
        monkeypatch.delenv(name, raising=False)
    last = max(os.sched_getaffinity(0))
    assert decode_lead_cpu("auto", 1, False) == last
    assert decode_lead_cpu("auto", 2, False) is None  # whose engine thread would it be?
    assert decode_lead_cpu("auto", 1, True) is None  # the user placed the roles
    assert decode_lead_cpu("off", 1, False) is None
    assert decode_lead_cpu("0", 2, True) == 0
    for bad in ("4096", "one"):
        with pytest.raises(LaunchError, match="--decode-lead-cpu"):
            decode_lead_cpu(bad, 1, False)
    envs = _worker_envs(monkeypatch, tmp_path, 2)
    assert envs["decode-0"] == {"KVMESH_LEAD_CPU": str(last)}
    assert envs["prefill-0"] == {"KVMESH_NUM_THREADS": "1"}  # anywhere, as without a lead
    monkeypatch.setenv("KVMESH_LEAD_CPU", str(last))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1} - {last})
    assert env.serve_threads() == 2  # its team: the engine thread and one on the rest


@TWO_CPUS
def test_children_run_on_the_cpus_they_are_given(tmp_path: Path) -> None:
    supervisor = Supervisor(dict(os.environ), say=lambda _: None)
    show = ["grep", "Cpus_allowed_list", "/proc/self/status"]
    supervisor.spawn("a", show, tmp_path / "a.log", cpus=frozenset({0}))
    supervisor.children["a"].proc.wait(timeout=10)
    assert (tmp_path / "a.log").read_text().split()[-1] == "0"


def test_a_child_gets_its_own_environment_on_top_and_keeps_it(tmp_path: Path) -> None:
    supervisor = Supervisor({**os.environ, "SHARED": "s"}, say=lambda _: None)
    show = ["sh", "-c", 'echo "$SHARED $OWN"']
    supervisor.spawn("a", show, tmp_path / "a.log", {"OWN": "x"})
    supervisor.spawn("b", show, tmp_path / "b.log")
    for child in supervisor.children.values():
        child.proc.wait(timeout=10)
    assert (tmp_path / "a.log").read_text().split() == ["s", "x"]
    assert (tmp_path / "b.log").read_text().split() == ["s"]
    assert supervisor.children["a"].env["OWN"] == "x"  # what a restart starts it with
