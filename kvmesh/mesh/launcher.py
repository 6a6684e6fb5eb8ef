"""`kvmesh up`: etcd + one gateway + N prefill + M decode workers as separate processes on
loopback; waits for health, prints where to send requests, stops everything on Ctrl-C/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.env import kvmesh_home
from kvmesh.errors import LaunchError
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.etcd_server import EtcdServer
from kvmesh.mesh.ports import free_port


@dataclass(frozen=True)
class UpOptions:
    model: str = "smollm2-135m"
    prefill: int = 1
    decode: int = 1
    http_port: int | None = None
    grpc_port: int | None = None
    cluster: str = "default"
    worker_args: tuple[str, ...] = ()  # passed through to every worker (e.g. --dtype bf16)
    role_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # after worker_args
    gateway_args: tuple[str, ...] = ()  # passed through to the gateway (e.g. --routing least-load)
    kvstore: str = "none"  # "builtin": the KV store service; "mooncake": backed by Mooncake Store
    kvstore_args: tuple[str, ...] = ()
    ready_timeout: float = 180.0


def state_file() -> Path:
    return kvmesh_home() / "run" / "up.json"


@dataclass
class Mesh:
    options: UpOptions
    run_dir: Path = field(
        default_factory=lambda: kvmesh_home() / "run" / time.strftime("%Y%m%d-%H%M%S")
    )
    etcd: EtcdServer | None = None
    master: Any = None  # MooncakeMaster with --kvstore mooncake
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    http_port: int = 0
    grpc_port: int = 0

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer()
        self.etcd.start()
        self.http_port = self.options.http_port or free_port()
        self.grpc_port = self.options.grpc_port or free_port()
        if self.options.kvstore in ("builtin", "mooncake"):
            args = [*self._kvstore_layout(), *self._kvstore_backend(), *self.options.kvstore_args]
            self._spawn("kvstore", ["serve", "kvstore", *args])
        if self._remote_draft():
            head = _flag(self.options.worker_args, "--draft-model")
            extra = ["--draft-model", head] if head else []
            self._spawn("draft", ["serve", "draft", "--model", self.options.model, *extra])
        for role, count in (("prefill", self.options.prefill), ("decode", self.options.decode)):
            for i in range(count):
                self._spawn(
                    f"{role}-{i}",
                    [
                        "serve",
                        role,
                        "--worker-id",
                        f"{role}-{i}",
                        "--model",
                        self.options.model,
                        *self.options.worker_args,
                        *self.options.role_args.get(role, ()),
                    ],
                )
        self._spawn(
            "gateway",
            [
                "serve",
                "gateway",
                "--model",
                self.options.model,
                "--http-port",
                str(self.http_port),
                "--grpc-port",
                str(self.grpc_port),
                *self.options.gateway_args,
            ],
        )
        self._write_state()
        self._wait_ready()

    def _kvstore_backend(self) -> list[str]:
        """--kvstore mooncake: start mooncake_master; the store's second tier is Mooncake Store."""
        if self.options.kvstore != "mooncake":
            return []
        from kvmesh.mesh.mooncake_master import MooncakeMaster

        self.master = MooncakeMaster()
        self.master.start()
        return ["--backend", "mooncake", "--mooncake-master", self.master.address]

    def _kvstore_layout(self) -> list[str]:
        """The store must hold pages of exactly the workers' layout (model, page, dtype)."""
        from kvmesh.engine.config import compute_dtype_of
        from kvmesh.engine.kv.layout import KVCacheSpec, resolve_kv_dtype
        from kvmesh.engine.loader import read_config, resolve_model

        args = list(self.options.worker_args)
        compute = compute_dtype_of(
            _flag(args, "--dtype") or "auto", _flag(args, "--weights") or "auto"
        )
        kv_dtype = resolve_kv_dtype(_flag(args, "--kv-dtype") or "auto", compute)
        config = read_config(resolve_model(self.options.model))
        spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, 16, kv_dtype)
        model = resolve_model(self.options.model).name
        return ["--model", model, "--page-size", "16", "--kv-dtype", kv_dtype,
                "--page-bytes", str(spec.page_bytes)]  # fmt: skip

    def _spawn(self, name: str, args: list[str]) -> None:
        assert self.etcd is not None
        cmd = [
            sys.executable,
            "-m",
            "kvmesh.cli",
            *args,
            "--etcd",
            self.etcd.endpoint,
            "--cluster",
            self.options.cluster,
        ]
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        log = (self.run_dir / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.ready_timeout
        stores = 1 if self.options.kvstore in ("builtin", "mooncake") else 0
        want = (self.options.prefill, self.options.decode, stores, int(self._remote_draft()))
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise LaunchError(
                    f"{dead[0]} exited during start-up; see {self.run_dir / dead[0]}.log"
                )
            if self._live_counts() == want:
                return
            time.sleep(0.5)
        raise LaunchError(
            f"the mesh was not ready within {self.options.ready_timeout:.0f}s; logs in {self.run_dir}"
        )

    def _remote_draft(self) -> bool:
        args = self.options.worker_args
        return _flag(args, "--speculative") == "eagle" and _flag(args, "--draft") == "remote"

    def _live_counts(self) -> tuple[int, ...] | None:
        """Workers registered in etcd, once the gateway answers /health."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2):
                pass
        except OSError:
            return None
        assert self.etcd is not None
        workers = asyncio.run(list_workers(self.etcd.endpoint, self.options.cluster))
        return tuple(
            sum(w.role == role for w in workers)
            for role in ("prefill", "decode", "kvstore", "draft")
        )

    def _write_state(self) -> None:
        assert self.etcd is not None
        state = {
            "etcd": self.etcd.endpoint,
            "cluster": self.options.cluster,
            "pid": os.getpid(),
            "http": f"127.0.0.1:{self.http_port}",
            "grpc": f"127.0.0.1:{self.grpc_port}",
            "logs": str(self.run_dir),
        }
        state_file().parent.mkdir(parents=True, exist_ok=True)
        state_file().write_text(json.dumps(state))

    def wait(self) -> int:
        """Block until a signal arrives or a process dies; returns an exit code."""
        stop = {"sig": None}

        def handler(signum, frame):  # noqa: ARG001
            stop["sig"] = signum

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        while stop["sig"] is None:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                print(
                    f"kvmesh: {dead[0]} exited; stopping the mesh (log: {self.run_dir / dead[0]}.log)"
                )
                return 1
            time.sleep(0.5)
        return 0

    def stop(self) -> None:
        for name in ["gateway", *[n for n in self.procs if n != "gateway"]]:
            _terminate_group(self.procs.get(name), signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _terminate_group(proc, signal.SIGKILL)
                proc.wait(timeout=5)
        if self.master is not None:
            self.master.stop()
        if self.etcd is not None:
            self.etcd.stop()
        if (
            state_file().is_file()
            and json.loads(state_file().read_text()).get("pid") == os.getpid()
        ):
            state_file().unlink()


async def list_workers(etcd: str, cluster: str) -> list[WorkerInfo]:
    async with Registry(etcd, cluster) as registry:
        return await registry.list_workers()


def _terminate_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)


def run_up(options: UpOptions) -> int:
    mesh = Mesh(options)
    try:
        print(
            f"kvmesh: starting etcd, 1 gateway, {options.prefill} prefill, {options.decode} decode "
            f"(logs in {mesh.run_dir}) ...",
            flush=True,
        )
        mesh.start()
        _print_ready(mesh, options)
        return mesh.wait()
    finally:
        mesh.stop()
        print("kvmesh: stopped", flush=True)


def _print_ready(mesh: Mesh, options: UpOptions) -> None:
    url = f"http://127.0.0.1:{mesh.http_port}"
    print(
        f"""kvmesh is up: model {options.model}
  REST (OpenAI): {url}/v1    gRPC Gateway: 127.0.0.1:{mesh.grpc_port}    etcd: {mesh.etcd.endpoint}
  try:
    curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{options.model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
  Ctrl-C stops everything.""",
        flush=True,
    )


def _flag(args: tuple[str, ...], name: str) -> str:
    """The value following `name` in args ('' when absent)."""
    return args[args.index(name) + 1] if name in args[:-1] else ""
