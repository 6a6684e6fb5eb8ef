"""Conditions a mesh test waits on, read from the services' /metrics (never fixed sleeps)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator

import grpc

from kvmesh.mesh.launcher import Mesh, UpOptions, list_workers
from kvmesh.mesh.metrics_probe import metric_sum, samples  # noqa: F401 - the tests take them from here
from kvmesh.proto.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc


@contextlib.contextmanager
def running_mesh(options: UpOptions) -> Iterator[Mesh]:
    """A mesh on loopback for a module's tests, stopped on exit whatever happens."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    running = Mesh(options)
    try:
        running.start()
        yield running
    finally:
        running.stop()


@contextlib.contextmanager
def module_mesh(options: UpOptions) -> Iterator[Mesh]:
    """`running_mesh` for a module fixture, which then checks that no process outlived it."""
    with running_mesh(options) as running:
        yield running
    for proc in running.procs.values():
        assert proc.poll() is not None, "a mesh process outlived the fixture"


@contextlib.contextmanager
def mesh_with_faults(options: UpOptions, faults: str) -> Iterator[Mesh]:
    """A running mesh whose processes inherit KVMESH_FAULTS; stopped on exit."""
    with mesh_with_env(options, KVMESH_FAULTS=faults) as running:
        yield running


@contextlib.contextmanager
def mesh_with_env(options: UpOptions, **env: str) -> Iterator[Mesh]:
    """A running mesh whose processes inherit `env` (the test's own environment is restored as
    soon as they are started); stopped on exit."""
    saved = dict(os.environ)
    os.environ.update(MC_TCP_BIND_ADDRESS="127.0.0.1", **env)
    running = Mesh(options)
    try:
        running.start()
        os.environ.clear()
        os.environ.update(saved)
        yield running
    finally:
        os.environ.clear()
        os.environ.update(saved)
        running.stop()


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} (not within {timeout_s} s)"
        time.sleep(0.05)


def _engines(mesh):
    workers = asyncio.run(list_workers(mesh.etcd.endpoint, "default"))
    return [w for w in workers if w.role in ("prefill", "decode")]


def _gateway(mesh, name: str) -> dict[str, float]:
    return {dict(k)["worker"]: v for k, v in samples(f"127.0.0.1:{mesh.http_port}", name).items()}


def _hashed_pages(worker) -> int:
    """Pages holding a prefix hash on `worker` after its last step (its GetLoads)."""
    is_prefill = worker.role == "prefill"
    stub_cls = prefill_pb2_grpc.PrefillStub if is_prefill else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(worker.grpc_address) as ch:
        reply = stub_cls(ch).GetLoads(decode_pb2.GetLoadsRequest(), timeout=5)
    return reply.loads[0].kv_pages_hashed


def router_caught_up(mesh) -> bool:
    """The gateway's prefix index holds, for every worker, as many pages as the worker hashed:
    it has applied every KV event the workers' steps so far produced."""
    index = _gateway(mesh, "kvmesh_router_index_pages")
    return all(index.get(w.worker_id) == _hashed_pages(w) for w in _engines(mesh))


def router_sees_idle(mesh) -> bool:
    """Every worker's last load report to the gateway was zero tokens."""
    loads = _gateway(mesh, "kvmesh_router_worker_load_tokens")
    return all(loads.get(w.worker_id) == 0 for w in _engines(mesh))


def offers_done(mesh) -> bool:
    """No worker has a page offer to the KV store in flight."""
    return all(
        sum(samples(w.metrics_address, "kvmesh_kv_store_offers_in_flight").values()) == 0
        for w in _engines(mesh)
    )


def pages_in_use(mesh) -> int:
    """KV pages held on every prefill and decode worker (each worker's GetLoads)."""
    from kvmesh.mesh.status import _collect

    workers = asyncio.run(_collect(mesh.etcd.endpoint, "default"))
    return sum(int((w["load"] or {}).get("kvPagesUsed", 0)) for w in workers)


def live_workers(mesh, role: str) -> list:
    """The `role` workers registered in etcd now."""
    return [w for w in _engines(mesh) if w.role == role]
