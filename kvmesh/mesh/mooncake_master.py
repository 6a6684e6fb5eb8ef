"""A Mooncake Store master on loopback, run from the binary in the mooncake wheel (dev and tests).

Clients that use "P2PHANDSHAKE" metadata need neither etcd nor an HTTP metadata server. The
master keeps its metadata in memory only: a restarted master has no keys.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO

import structlog

from kvmesh.errors import MooncakeMasterError
from kvmesh.mesh.ports import free_ports
from kvmesh.processes import spawn, terminate_group

log = structlog.get_logger(__name__)

_HOST = "127.0.0.1"


def master_binary() -> Path:
    """The `mooncake_master` binary shipped inside the `mooncake` package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeMasterError("mooncake is not installed: pip install mooncake-transfer-engine")
    path = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise MooncakeMasterError(f"mooncake_master missing or not executable: {path}")
    return path


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((_HOST, port), timeout=0.2):
        return True
    return False


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


class MooncakeMaster:
    """One `mooncake_master` process in its own process group, dying with this process
    (PR_SET_PDEATHSIG), logging to `log_path`."""

    def __init__(self, rpc_port: int | None = None, metrics_port: int | None = None) -> None:
        picked = free_ports(2)
        self.rpc_port = rpc_port or picked[0]
        self.metrics_port = metrics_port or picked[1]
        self.log_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{_HOST}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """Started and not exited (False once it died on its own, or was stopped)."""
        return self._proc is not None and self._proc.poll() is None

    def _command(self) -> list[str]:
        return [
            str(master_binary()),
            f"--rpc_address={_HOST}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={_HOST}",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
        ]

    def start(self, timeout: float = 15.0) -> None:
        """Launch the master; return once its RPC port accepts TCP, else raise with the log."""
        if self._proc is not None:
            raise MooncakeMasterError(f"master already running (pid {self._proc.pid})")
        fd, name = tempfile.mkstemp(prefix="kvmesh-mooncake-master-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log_file = self.log_path.open("ab")
        self._proc = spawn(self._command(), self._log_file)
        if not self._wait_ready(timeout):
            tail = _tail(self.log_path)
            self.stop()
            raise MooncakeMasterError(f"mooncake_master did not listen on {self.address}:\n{tail}")
        log.info("mooncake_master.started", address=self.address, pid=self.pid)

    def _wait_ready(self, timeout: float) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if _accepts(self.rpc_port):
                return self._proc.poll() is None  # guards against another listener on the port
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout`. The log file is kept."""
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate_group(proc, timeout)
            log.info("mooncake_master.stopped", address=self.address, pid=proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> MooncakeMaster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
