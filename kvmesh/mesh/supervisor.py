"""The launcher's children: each in its own session and dying with the launcher, watched while the
mesh runs, restarted with backoff when one dies (unless it is critical), stopped together."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from kvmesh.processes import spawn, stop_groups


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # per child, counted since it last ran `stable_s` without dying
    backoff_s: float = 1.0  # before the first restart; doubled for each further one
    stable_s: float = 300.0

    def delay(self, restarts: int) -> float | None:
        """Seconds to wait before restart number `restarts + 1`; None: the budget is spent."""
        return None if restarts >= self.max_restarts else self.backoff_s * 2**restarts


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen
    started_at: float
    env: Mapping[str, str] | None = None  # None: the supervisor's environment
    cpus: frozenset[int] | None = None  # where its threads run (None: where ours may)
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of a scheduled restart
    given_up: bool = False

    def exited(self) -> str:
        """ "<name> exited (<how>; log: <path>)", for a child whose process ended."""
        how = describe_exit(self.proc.returncode)
        return f"{self.name} exited ({how}; log: {self.log_path})"


def _nothing_deferred() -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class Supervisor:
    """`say` reports deaths and restarts (the launcher's stdout); `defer` holds stop signals off
    while a child is spawned and recorded; `on_change` runs after each (re)spawn."""

    def __init__(
        self,
        env: Mapping[str, str],
        say: Callable[[str], None],
        policy: RestartPolicy = RestartPolicy(),
        critical: frozenset[str] = frozenset(),
        defer: Callable[[], AbstractContextManager[None]] = _nothing_deferred,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.env = dict(env)
        self.say = say
        self.policy = policy
        self.critical = critical
        self.defer = defer
        self.on_change = on_change
        self.children: dict[str, Child] = {}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """The current process of each child."""
        return {name: child.proc for name, child in self.children.items()}

    def pids(self) -> dict[str, int]:
        return {name: child.proc.pid for name, child in self.children.items()}

    def spawn(
        self,
        name: str,
        cmd: list[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        """Start child `name`; `env` (e.g. its KVMESH_CPUS) is added to the supervisor's
        environment, for this child and its restarts; `cpus`: where its threads run."""
        child_env = {**self.env, **env} if env else None
        with self.defer():
            proc = self._start(cmd, log_path, "w", child_env, cpus)
            self.children[name] = Child(
                name, cmd, log_path, proc, time.monotonic(), child_env, cpus
            )
        self.on_change()

    def _start(
        self,
        cmd: list[str],
        log_path: Path,
        mode: str,
        env: Mapping[str, str] | None,
        cpus: frozenset[int] | None,
    ) -> subprocess.Popen:
        with log_path.open(mode + "b") as log:  # the child keeps its own copy of the fd
            return spawn(cmd, log, self.env if env is None else env, cpus)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children.values() if c.proc.poll() is not None), None)

    def check(self) -> Child | None:
        """One look at every child: report the ones that died and restart them when due.
        Returns a critical child that died (the caller stops the mesh), else None."""
        now = time.monotonic()
        for child in self.children.values():
            if child.given_up:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child)
                continue
            if child.proc.poll() is None:
                continue
            if child.name in self.critical:
                return child
            self._schedule(child, now)
        return None

    def _schedule(self, child: Child, now: float) -> None:
        if now - child.started_at >= self.policy.stable_s:
            child.restarts = 0
        delay = self.policy.delay(child.restarts)
        died = f"kvmesh: {child.exited()}"
        if delay is None:
            child.given_up = True
            self.say(f"{died}; restarted {child.restarts} times already, giving up on it")
            return
        child.restart_at = now + delay
        self.say(
            f"{died}; restarting it in {delay:g}s ({child.restarts + 1}/{self.policy.max_restarts})"
        )

    def _restart(self, child: Child) -> None:
        with self.defer():
            child.proc = self._start(child.cmd, child.log_path, "a", child.env, child.cpus)
            child.started_at, child.restart_at = time.monotonic(), None
            child.restarts += 1
        self.on_change()  # the state file names the new pid before anyone reads "restarted"
        self.say(f"kvmesh: {child.name} restarted (pid {child.proc.pid})")

    def stop(self, grace: float, first: tuple[str, ...] = ()) -> None:
        """Stop the children named in `first` (in that order), then all others together."""
        order = [
            *(self.children[n] for n in first if n in self.children),
            *(c for n, c in self.children.items() if n not in first),
        ]
        stop_groups([child.proc for child in order], grace)


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
