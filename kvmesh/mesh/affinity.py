"""A worker's CPU set: every thread of the process pinned to it (os.sched_setaffinity) and torch's
intra-op pool sized to it, so prefill, decode and gateway sharing a machine do not oversubscribe
its cores. The set travels as `KVMESH_CPUS` (kvmesh.env): `kvmesh up` gives each worker its
role's set, `kvmesh serve prefill|decode --cpus` its own.

A lead CPU (`KVMESH_LEAD_CPU`) is one the worker's engine thread keeps to itself: that thread runs
the serial work between steps and leads each step's OpenMP team, so any other thread that
preempts it delays the whole step, while the team's other threads hand their share of a decode
step to whoever is free (kernels/csrc/phases.h). `kvmesh up` (`--decode-lead-cpu auto`, the
default) gives a lone decode worker the last CPU, moves the worker's OpenMP team to the rest and
starts the gateway there: a token's socket write woke the gateway on the engine thread's CPU
(where Linux puts a task woken through a socket) and stalled the next step. The worker's other
threads (event loop, gRPC) stay free: kept on the rest with the gateway, they delayed first
tokens. Measured in docs/benchmarks-history.md, "Tokens leave from the engine thread, and a CPU
of its own for the decode engine thread"."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh import env
from kvmesh.errors import LaunchError


@dataclass(frozen=True)
class WorkerCpus:
    """What a worker runs on after `apply_worker_cpus`."""

    cpus: frozenset[int]
    torch_threads: int
    pinned: bool  # False: KVMESH_CPUS unset, the process kept the CPUs it was started with


def format_cpus(cpus: Iterable[int]) -> str:
    """The shortest CPU list: {0, 1, 2, 5} -> "0-2,5"."""
    ordered = sorted(set(cpus))
    runs: list[list[int]] = []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def checked_cpus(text: str) -> frozenset[int]:
    """`text` parsed, and only CPUs this process may use (LaunchError otherwise)."""
    try:
        cpus = env.parse_cpus(text)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise LaunchError(
            f"CPUs {format_cpus(cpus - allowed)} are not available here (allowed: "
            f"{format_cpus(allowed)})"
        )
    return cpus


def worker_env(role: str, cpus: str | None = None) -> dict[str, str]:
    """The environment that pins a worker of `role` launched from here: KVMESH_CPUS = `cpus`,
    else KVMESH_<ROLE>_CPUS; checked here, so a bad list stops the launch, not the worker."""
    cpus = cpus or env.role_cpus(role)
    return {"KVMESH_CPUS": format_cpus(checked_cpus(cpus))} if cpus else {}


def decode_lead_cpu(choice: str, decode_workers: int, roles_placed: bool) -> int | None:
    """`kvmesh up --decode-lead-cpu`: the CPU the decode worker's engine thread keeps to itself,
    or None. auto: the last CPU this process may use, for a lone decode worker on 2+ CPUs when
    no role was given CPUs of its own (then the user placed them)."""
    allowed = os.sched_getaffinity(0)
    if choice == "off":
        return None
    if choice != "auto":
        if not choice.isdigit() or int(choice) not in allowed:
            raise LaunchError(
                f"--decode-lead-cpu: {choice!r} is not one of the CPUs here "
                f"({format_cpus(allowed)}), auto or off"
            )
        return int(choice)
    if decode_workers != 1 or roles_placed or len(allowed) < 2:
        return None
    return max(allowed)


@contextlib.contextmanager
def thread_kept_to(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread (and threads it starts) runs on `cpus` inside the block (None: as
    it was); e.g. a benchmark's client kept off the decode engine thread's lead CPU."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_process(cpus: frozenset[int]) -> None:
    """Restrict every thread of this process to `cpus`; threads started later inherit it."""
    for tid in _thread_ids():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def _thread_ids() -> list[int]:
    tasks = Path("/proc/self/task")
    return [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]


def apply_worker_cpus() -> WorkerCpus:
    """At a worker's start, before its engine loads: pin to KVMESH_CPUS when set, then size
    torch's pool to env.serve_threads() (KVMESH_NUM_THREADS, else one thread per CPU)."""
    import structlog  # here, not at the top: the CLI's parser imports this module
    import torch

    wanted = env.worker_cpus()
    if wanted:
        pin_process(checked_cpus(wanted))
    threads = env.serve_threads()
    torch.set_num_threads(threads)
    placed = WorkerCpus(frozenset(os.sched_getaffinity(0)), threads, wanted is not None)
    log = structlog.get_logger(__name__)
    log.info(
        "worker.cpus",
        cpus=format_cpus(placed.cpus),
        torch_threads=threads,
        pinned=placed.pinned,
        lead_cpu=env.lead_cpu(),
    )
    return placed


def lead_cpu_setup() -> Callable[[], None] | None:
    """Where a lead CPU is set (KVMESH_LEAD_CPU), what the engine thread runs first: it starts
    its OpenMP team (the threads that appear meanwhile), moves the team to the rest and keeps
    the lead CPU alone (a preempted team thread hands its chunks on: csrc/phases.h). The
    worker's other threads (event loop, gRPC) stay free: on the rest with the gateway they
    delayed first tokens (see the module doc). None without a lead CPU."""
    lead = env.lead_cpu()
    if lead is None:
        return None

    def take_lead_cpu() -> None:
        import structlog
        import torch

        before = set(_thread_ids())
        torch.ones(1 << 20).add_(1)  # an OpenMP region: this thread's team starts here
        team = sorted(set(_thread_ids()) - before)
        rest = frozenset(os.sched_getaffinity(0)) - {lead}
        log = structlog.get_logger(__name__)
        try:
            for tid in team:
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(tid, rest)
            os.sched_setaffinity(0, {lead})
        except OSError as exc:  # not a CPU this machine lets us use: run as without one
            log.warning("worker.lead_cpu_refused", cpu=lead, error=repr(exc))
            return
        log.info("worker.lead_cpu", cpu=lead, team=team, team_cpus=format_cpus(rest))

    return take_lead_cpu


class ExportCpus(argparse.Action):
    """`--cpus LIST` (and `kvmesh up --prefill-cpus/--decode-cpus`): checked, kept as the
    canonical list, and exported to this process's environment (`env_name`), where the worker
    (KVMESH_CPUS) or the launcher (KVMESH_<ROLE>_CPUS) reads it."""

    def __init__(self, option_strings: Sequence[str], dest: str, env_name: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.env_name = env_name

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            cpus = format_cpus(checked_cpus(str(values)))
        except LaunchError as exc:
            parser.error(f"{option_string}: {exc}")
        setattr(namespace, self.dest, cpus)
        os.environ[self.env_name] = cpus
