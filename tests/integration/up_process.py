"""`kvmesh up` as a subprocess for lifecycle tests: its own KVMESH_HOME (which also marks every
process it starts: they inherit the variable), its stdout collected, readiness probed from the
first instant, and a clean-up that leaves nothing behind even when the launcher misbehaves."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.env import kvmesh_home
from kvmesh.mesh.ports import free_port
from kvmesh.processes import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def alive(pid: int) -> bool:
    """Running and not a zombie (a reparented child nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def marked(home: Path) -> set[int]:
    """Live processes whose environment says KVMESH_HOME=home: everything that run started."""
    marker = f"KVMESH_HOME={home}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
    return {pid for pid in found if alive(pid)}


def descendants(root: int) -> set[int]:
    """Every process below `root` by parent links (children in new sessions included)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def until(condition: Callable[[], Any], timeout: float, period: float = 0.1) -> Any:
    """Poll `condition` until it is truthy or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(period)
    return value


def http(method: str, url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, Any]:
    """(status, JSON body); (0, None) when nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except OSError:
        return 0, None


def chat(http_port: int) -> tuple[int, Any]:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    return http("POST", f"http://127.0.0.1:{http_port}/v1/chat/completions", body, timeout=120)


@dataclass
class Probe:
    """One look at readiness: /health's answer and the gRPC health status (None: no answer)."""

    status: int
    body: Any
    grpc: int | None


@dataclass
class ReadinessProbe:
    """Polls /health (and gRPC health) from launch; on the first 200 sends a chat at once."""

    http_port: int
    grpc_port: int
    probes: list[Probe] = field(default_factory=list)
    chat: tuple[int, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self, timeout: float) -> None:
        threading.Thread(target=self._run, args=(timeout,), daemon=True).start()

    def _run(self, timeout: float) -> None:
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 300),
        ]
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}", options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                status, body = http("GET", f"http://127.0.0.1:{self.http_port}/health", timeout=2)
                self.probes.append(Probe(status, body, _grpc_status(stub)))
                if status == 200:
                    self.chat = chat(self.http_port)
                    break
                time.sleep(0.1)
        self.done.set()


def _grpc_status(stub: health_pb2_grpc.HealthStub) -> int | None:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
    except grpc.RpcError:
        return None


def grpc_health(port: int) -> int | None:
    """The server-wide grpc.health.v1 status on 127.0.0.1:port (None: no answer)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return _grpc_status(health_pb2_grpc.HealthStub(channel))


def text_of(url: str) -> str:
    with _OPENER.open(url, timeout=5) as response:
        return response.read().decode()


@dataclass
class UpRun:
    home: Path
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls, tmp: Path, *args: str, wrap: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> UpRun:
        """`kvmesh up ARGS` (through `wrap`, e.g. `ip netns exec NS`; `env` added to ours),
        killed if we die."""
        home = tmp / "home"
        home.mkdir(parents=True)
        (home / "models").symlink_to(kvmesh_home() / "models")  # the fetched default model
        env = {
            **os.environ,
            **(env or {}),
            "KVMESH_HOME": str(home),
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        }
        http_port, grpc_port = free_port(), free_port()
        cmd = [
            *wrap,
            sys.executable,
            "-m",
            "kvmesh.cli",
            "up",
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            *args,
        ]
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )
        run = cls(home, proc, http_port, grpc_port)
        threading.Thread(target=run._read, daemon=True).start()
        return run

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, fragment: str) -> str | None:
        return next((line for line in list(self.lines) if fragment in line), None)

    def state(self) -> dict[str, Any]:
        path = self.home / "run" / "up.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def output(self) -> str:
        return "\n".join(self.lines)

    def close(self) -> None:
        """Stop the launcher, then SIGKILL whatever of this run is still there."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in marked(self.home):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
