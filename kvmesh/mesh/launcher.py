"""`kvmesh up`: etcd + one gateway + N prefill + M decode workers (+ KV store, draft service) as
separate processes on loopback; waits until a request would succeed, prints where to send them.

SIGINT, SIGTERM or SIGHUP at any moment (starting, running, stopping) stops everything it started;
its children also die when it is SIGKILLed (PR_SET_PDEATHSIG). While the mesh runs, a worker, the
KV store or the draft service that dies is reported and restarted (up to 3 times, with backoff);
only etcd or the gateway dying stops the mesh: without either no request can be served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import sys
import time
import urllib.request
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvmesh.env import API_KEYS_ENV, kvmesh_home, num_threads, role_cpus
from kvmesh.errors import LaunchError
from kvmesh.mesh import children
from kvmesh.mesh.affinity import decode_lead_cpu, worker_env
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.etcd_access import EtcdAccess
from kvmesh.mesh.etcd_server import EtcdServer
from kvmesh.mesh.ports import free_port
from kvmesh.mesh.supervisor import Supervisor
from kvmesh.mesh.tls import TlsFiles
from kvmesh.mesh.up_config import UpOptions
from kvmesh.processes import StopSignals

MESH_CERT_NAME = "mesh"  # `up --tls`: the common name of every service's certificate
CRITICAL = frozenset({"gateway"})  # with etcd: the mesh stops when one of them dies
STOP_GRACE_S = 6.0  # SIGTERM, then SIGKILL: a stop signal leaves nothing behind within 10 s
# No proxy for loopback health checks, whatever http_proxy says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def state_file() -> Path:
    return kvmesh_home() / "run" / "up.json"


@dataclass
class Mesh:
    options: UpOptions
    run_dir: Path = field(
        default_factory=lambda: kvmesh_home() / "run" / time.strftime("%Y%m%d-%H%M%S")
    )
    signals: StopSignals | None = None  # `kvmesh up`: held off while a child is being recorded
    etcd: EtcdServer | None = None
    master: Any = None  # MooncakeMaster with --kvstore mooncake
    http_port: int = 0
    grpc_port: int = 0
    supervisor: Supervisor = field(init=False)
    tls: TlsFiles | None = field(default=None, init=False)  # every service's certificate
    lead: int | None = field(default=None, init=False)  # the decode engine thread's own CPU
    cpus: frozenset[int] | None = field(default=None, init=False)  # the gateway's: all but lead
    _stopped: bool = field(default=False, init=False)
    _master_reported: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        if self._crowded():  # parallel loads would thrash the cores
            env.setdefault("KVMESH_LOAD_THREADS", "1")  # measured: docs/benchmarks.md, cold start
        o = self.options
        placed = any(o.role_cpus.get(r) or role_cpus(r) for r in ("prefill", "decode"))
        self.lead = decode_lead_cpu(o.decode_lead_cpu, o.decode, placed)
        self.cpus = None if self.lead is None else frozenset(os.sched_getaffinity(0)) - {self.lead}
        self.supervisor = Supervisor(
            env, say, critical=CRITICAL, defer=self._deferred, on_change=self._write_state
        )

    @property
    def procs(self) -> dict[str, Any]:
        """The current process of each child (etcd and mooncake_master aside)."""
        return self.supervisor.procs

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.options.tls:
            from kvmesh.mesh.certs import make_ca, make_leaf

            ca = make_ca(self.run_dir / "tls")
            self.tls = make_leaf(self.run_dir / "tls", MESH_CERT_NAME, ca)
        self.etcd = EtcdServer(tls=self.tls)
        self.etcd.start()
        if self.tls is not None:  # etcd over TLS, its users the certificates' common names
            self.etcd.enable_auth(MESH_CERT_NAME)
        self.http_port = self.options.http_port or free_port()
        self.grpc_port = self.options.grpc_port or free_port()
        self._write_state()
        if self.options.kvstore in ("builtin", "mooncake"):
            self._start_master()
            self._spawn_config("kvstore", children.kvstore(self.options, self.placement))
        if children.remote_draft(self.options):
            self._spawn_config("draft", children.draft(self.options, self.placement))
        self._spawn_workers()
        self._spawn_gateway()
        self._wait_ready()

    def _spawn_workers(self) -> None:
        o = self.options
        for role, count in (("prefill", o.prefill), ("decode", o.decode)):
            pinned = worker_env(role, o.role_cpus.get(role))
            if role == "decode" and self.lead is not None:  # affinity.lead_cpu_setup
                pinned = {**pinned, "KVMESH_LEAD_CPU": str(self.lead)}
            for i in range(count):
                name = f"{role}-{i}"
                config = children.worker(self.options, self.placement, role, name)
                self._spawn_config(name, config, pinned or self._threads(role))

    def _crowded(self) -> bool:
        """Fewer than two CPUs per engine process on this machine."""
        return (self.options.prefill + self.options.decode) * 2 > (os.cpu_count() or 1)

    def _threads(self, role: str) -> dict[str, str]:
        """Torch threads per unpinned worker on a crowded machine: two OpenMP teams spinning on
        the same cores stall each other's barriers for whole time slices. Prefill, bursty,
        serves on one thread (with a thread per CPU, a burst of requests took several times
        longer); decode workers, busy at every step, share the CPUs (with a thread per CPU
        each, two decode workers ran many times slower than one engine). Measured in
        docs/benchmarks-history.md, "A Xeon without AMX: bf16 linears in register tiles,
        attention in registers, host work, prefill threads" and "The 2P+2D mesh on 2 cores, and
        grammar masks only where the argmax needs one". KVMESH_NUM_THREADS overrides both."""
        if num_threads() or not self._crowded():
            return {}
        if role == "prefill":
            return {"KVMESH_NUM_THREADS": "1"}
        cpus = os.cpu_count() or 1
        share = max(1, cpus // self.options.decode)  # called for decode workers: decode >= 1
        return {"KVMESH_NUM_THREADS": str(share)} if share < cpus else {}

    def _spawn_gateway(self) -> None:
        config = children.gateway(self.options, self.placement)
        keys = config.api.api_key  # in its environment, not in a file or argv (`ps` shows it)
        config = replace(config, api=replace(config.api, api_key=()))
        env = {API_KEYS_ENV: "\n".join(keys)} if keys else None
        self._spawn_config("gateway", config, env, self.cpus)

    @property
    def placement(self) -> children.RunFacts:
        """What this run placed its children with (etcd, the gateway's ports, the master, TLS)."""
        master = self.master.address if self.master is not None else children.UNPLACED
        etcd = self.etcd.endpoint if self.etcd is not None else children.UNPLACED
        tls = (
            ("", "", "")
            if self.tls is None
            else (str(self.tls.cert), str(self.tls.key), str(self.tls.ca))
        )
        return children.RunFacts(etcd, self.http_port, self.grpc_port, master, tls)

    def _spawn_config(self, name: str, config: Any, env=None, cpus=None) -> None:
        """Start child `name` with its config as a file (`kvmesh serve ... --config FILE`)."""
        service = name.split("-")[0]  # prefill-0 -> prefill; gateway, kvstore, draft as named
        path = children.write(self.run_dir, name, config)
        self._spawn(name, ["serve", service, "--config", str(path)], env, cpus)

    def _start_master(self) -> None:
        """--kvstore mooncake: start mooncake_master; the store's second tier is Mooncake Store."""
        if self.options.kvstore != "mooncake":
            return
        from kvmesh.mesh.mooncake_master import MooncakeMaster

        self.master = MooncakeMaster()
        self.master.start()
        self._write_state()

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        assert self.etcd is not None
        cmd = [sys.executable, "-m", "kvmesh.cli", *args]  # etcd, cluster, TLS: in its config
        self.supervisor.spawn(name, cmd, self.run_dir / f"{name}.log", env, cpus)

    def _deferred(self) -> AbstractContextManager[None]:
        return self.signals.deferred() if self.signals else contextlib.nullcontext()

    def _wait_ready(self) -> None:
        """Until the gateway says a request would succeed and every worker registered."""
        deadline = time.monotonic() + self.options.ready_timeout
        stores = 1 if self.options.kvstore in ("builtin", "mooncake") else 0
        draft = int(children.remote_draft(self.options))
        want = (self.options.prefill, self.options.decode, stores, draft)
        while time.monotonic() < deadline:
            dead = self.supervisor.first_exited()
            if dead is not None:
                raise LaunchError(f"{dead.exited()} during start-up")
            if gateway_ready(self.url, self.tls) and self._live_counts() == want:
                return
            time.sleep(0.1)
        raise LaunchError(
            f"the mesh was not ready within {self.options.ready_timeout:.0f}s; logs in {self.run_dir}"
        )

    def _live_counts(self) -> tuple[int, ...]:
        """Workers registered in etcd, by role."""
        assert self.etcd is not None
        with self._deferred():  # a signal inside asyncio.run would end up in some task
            workers = asyncio.run(
                list_workers(self.etcd.endpoint, self.options.cluster, self.etcd.access)
            )
        return tuple(
            sum(w.role == role for w in workers)
            for role in ("prefill", "decode", "kvstore", "draft")
        )

    @property
    def url(self) -> str:
        """Where clients send REST requests."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}"

    def pids(self) -> dict[str, int]:
        """The pid of every process the mesh runs (none before etcd starts)."""
        if self.etcd is None:
            return {}
        pids = {"etcd": self.etcd.pid, **self.supervisor.pids()}
        if self.master is not None:
            pids["mooncake_master"] = self.master.pid
        return pids

    def _write_state(self) -> None:
        """The run's state file (`kvmesh status` reads it), with the pid of every process."""
        if self.etcd is None:
            return  # nothing runs yet
        state = {
            "etcd": self.etcd.endpoint,
            "cluster": self.options.cluster,
            "pid": os.getpid(),
            "http": f"127.0.0.1:{self.http_port}",
            "url": self.url,
            "tls": None if self.tls is None else {k: str(v) for k, v in vars(self.tls).items()},
            "grpc": f"127.0.0.1:{self.grpc_port}",
            "logs": str(self.run_dir),
            "pids": self.pids(),
        }
        path = state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(state))
        partial.replace(path)  # readers never see half a file

    def wait(self) -> int:
        """Watch the mesh until a stop signal (StopSignal, raised out of here) or until etcd or
        the gateway dies (returns 1). Any other child that dies is reported and restarted (see
        Supervisor); a dead KV store costs only cache misses meanwhile."""
        while True:
            lost = self._critical_loss()
            if lost is not None:
                say(f"kvmesh: {lost}; stopping the mesh")
                return 1
            self._report_master()
            time.sleep(0.5)

    def _critical_loss(self) -> str | None:
        if self.etcd is not None and not self.etcd.alive:
            return "etcd exited"
        child = self.supervisor.check()
        return child.exited() if child is not None else None

    def _report_master(self) -> None:
        """A restarted master would hold no keys: the store runs on without its Mooncake tier."""
        if self.master is None or self.master.alive or self._master_reported:
            return
        self._master_reported = True
        say(
            f"kvmesh: mooncake_master exited (log: {self.master.log_path}); the KV store's "
            "Mooncake tier is gone (cache misses), not restarted"
        )

    def stop(self) -> None:
        """Stop everything started here, gateway first; idempotent, and no signal cuts it."""
        if self.signals is not None:
            self.signals.disarm()
        if self._stopped:
            return
        self._stopped = True
        self.supervisor.stop(STOP_GRACE_S, first=("gateway",))
        if self.master is not None:
            self.master.stop(timeout=2)
        if self.etcd is not None:
            self.etcd.stop(timeout=2)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(state_file().read_text()).get("pid") == os.getpid():
                state_file().unlink()


async def list_workers(
    etcd: str, cluster: str, access: EtcdAccess | None = None
) -> list[WorkerInfo]:
    async with Registry(etcd, cluster, access) as registry:
        return await registry.list_workers()


def gateway_ready(url: str, tls: TlsFiles | None = None) -> bool:
    """The gateway's /health is 200: it sees the workers a chat request needs."""
    opener = _OPENER
    if tls is not None:
        context = ssl.create_default_context(cafile=str(tls.ca))
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )
    try:
        with opener.open(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # not listening yet, or 503 (urllib's HTTPError is an OSError)
        return False


def say(text: str) -> None:
    """CLI output; a closed terminal (SIGHUP) must not cut a stop short."""
    with contextlib.suppress(OSError):
        print(text, flush=True)
