"""Runs a prefill or decode worker process: engine thread, transfer engine, gRPC server,
Prometheus endpoint, etcd registration with keep-alive, a drain on SIGTERM/SIGINT (NOT_SERVING,
lease revoked, new requests refused, those in flight given --drain-timeout to finish)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from kvmesh.config import EngineConfig, WorkerConfig
from kvmesh.engine.core.engine import Engine
from kvmesh.engine.core.faults import KINDS as FAULT_KINDS
from kvmesh.engine.core.listeners import EngineListeners
from kvmesh.engine.loader.memory import process_memory_mib
from kvmesh.engine.serving.async_engine import AsyncEngine
from kvmesh.engine.serving.engine_thread import build_engine
from kvmesh.mesh import addresses, metrics
from kvmesh.mesh.affinity import lead_cpu_setup
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.draft_client import RemoteProposer
from kvmesh.mesh.request_gate import RequestGate
from kvmesh.mesh.service_runtime import Listen, Served, serve_registered
from kvmesh.mesh.store_link import StoreLink, StoreLinkOptions
from kvmesh.mesh.transfer import KvTransferEngine, TransferConfig

log = structlog.get_logger(__name__)


def transfer_config(config: WorkerConfig) -> TransferConfig:
    """The transfer engine's settings (the addresses and NICs checked: `kvmesh serve` calls it
    before loading anything)."""
    service, transfer = config.service, config.transfer
    hostname = addresses.advertised(service.host, service.advertise_host, True)
    return TransferConfig(
        protocol=transfer.protocol, hostname=hostname, device=transfer.rdma_devices
    )


@dataclass(frozen=True)
class WorkerParts:
    """What a service needs to build its servicer."""

    config: WorkerConfig
    worker_id: str
    engine: AsyncEngine
    transfer: KvTransferEngine
    kv_dtype: str
    store: StoreLink | None
    gate: RequestGate  # every request-serving call goes through it (bound, drain)


ServicerFactory = Callable[[WorkerParts], list[Callable]]


class Listener(Protocol):
    """A server beside gRPC (decode's delivery socket), advertised in the etcd registration."""

    async def start(self, host: str, port: int = 0) -> int: ...  # the port it listens on

    def close(self) -> None: ...


async def serve_worker(
    config: WorkerConfig, make_servicers: ServicerFactory, delivery: Listener | None = None
) -> int:
    """Serve until SIGTERM / SIGINT (exit code 0) or until the engine is lost (1: a
    tensor-parallel rank died; the worker goes down whole, its lease revoked first)."""
    role, service = config.role, config.service
    worker_id = service.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    structlog.contextvars.bind_contextvars(service=role, worker_id=worker_id)
    draft_address = await _draft_address(config)
    draft = RemoteProposer(draft_address) if draft_address else None
    listeners = EngineListeners(
        integrity_failure=lambda _: metrics.KV_INTEGRITY_FAILURES.labels(role).inc(),
        fault_injected=lambda kind: metrics.FAULTS_INJECTED.labels(role, kind).inc(),
        speculation=_spec_metrics(role),
    )
    engine = build_engine(lambda: Engine(config.engine, draft, listeners))  # on its own thread
    if engine.faults is not None:
        log.warning("worker.fault_injection_on", faults=dict(engine.faults.plan.every))
    async_engine = AsyncEngine(engine, lead_cpu_setup())  # a lead CPU, where set
    async_engine.start()
    transfer = KvTransferEngine(transfer_config(config))
    public = transfer.config.hostname  # what peers dial (--advertise-host, else --host)
    region = engine.kv_pages.region  # every rank's pages (tensor parallelism: shared memory)
    transfer.register(region.data_ptr(), region.numel())
    transfer.register(engine.kv_cache.tags.data_ptr(), engine.kv_cache.tags.numel() * 4)
    store = None
    if config.serving.use_kvstore:
        link = StoreLinkOptions(service.etcd, service.cluster)
        store = StoreLink(link, async_engine, transfer, role)
    store_task = asyncio.create_task(store.run()) if store else None
    gate = RequestGate(
        config.serving.max_queued_requests, metrics.REQUESTS_IN_FLIGHT.labels(role).set
    )
    parts = WorkerParts(config, worker_id, async_engine, transfer, engine.kv_dtype, store, gate)
    metrics.KV_CAPACITY_TOKENS.labels(role).set(engine.kv_cache.capacity_tokens)
    metrics.init_series(role, fault_kinds=FAULT_KINDS)
    listen = Listen(
        role,
        worker_id,
        service.host,
        public,
        service.port,
        service.metrics_port,
        service.etcd,
        service.cluster,
        service.lease_ttl,
        log_as="worker",
    )
    try:
        delivery_address = ""
        if delivery is not None:
            delivery_port = await delivery.start(service.host, service.delivery_port)
            delivery_address = addresses.host_port(public, delivery_port)
        lost = await serve_registered(
            listen,
            make_servicers(parts),
            lambda served: _describe(engine, parts, served, delivery_address),
            lost=async_engine.lost,
            drain=lambda: gate.drain(config.serving.drain_timeout),
        )
    finally:
        if store_task is not None:
            store_task.cancel()
        if delivery is not None:
            delivery.close()
        async_engine.stop()
        engine.close()  # a tensor-parallel engine's other ranks
        transfer.close()
    if lost:
        log.error("worker.engine_lost", reason="a tensor-parallel rank of this worker is gone")
    return 1 if lost else 0


def _describe(
    engine: Engine, parts: WorkerParts, served: Served, delivery_address: str
) -> WorkerInfo:
    """The worker's etcd registration: where to reach it and what pages it holds."""
    config = engine.config
    return WorkerInfo(
        role=parts.config.role,
        worker_id=parts.worker_id,
        grpc_address=served.grpc,
        metrics_address=served.metrics,
        te_session=parts.transfer.session,
        delivery_address=delivery_address,
        model=engine.model_name,
        page_size=config.cache.page_size,
        kv_dtype=engine.kv_dtype,
        capacity_tokens=engine.kv_cache.capacity_tokens,
        extra={
            **_precision(config),
            "architecture": engine.model_config.architecture,
            "kv_spec": engine.kv_pages.spec.layout_key,
            "page_bytes": str(engine.kv_pages.spec.page_bytes),  # a KV store adopts the layout
            "tensor_parallel": str(config.parallel.tensor_parallel_size),
            "pipeline_parallel": str(config.parallel.pipeline_parallel_size),
            "ranks": _ranks(engine),
        },
    )


def _ranks(engine: Engine) -> str:
    """Each rank's process, device and resident memory after load (`kvmesh status`), JSON."""
    pids = [os.getpid(), *engine.rank_pids]
    return json.dumps(
        [
            {"rank": r, "pid": pid, "device": "cpu", **process_memory_mib(pid)}
            for r, pid in enumerate(pids)
        ]
    )


def _spec_metrics(role: str):
    def record(drafted: int, emitted: int) -> None:
        metrics.SPEC_DRAFT_TOKENS.labels(role).inc(drafted)
        metrics.SPEC_ACCEPTED_TOKENS.labels(role).inc(emitted - 1)
        metrics.SPEC_ACCEPT_LENGTH.labels(role).observe(emitted)

    return record


async def _draft_address(config: WorkerConfig, timeout_s: float = 120.0) -> str:
    """With --draft remote on a decode worker: the grpc address of a draft service in etcd."""
    eagle = config.engine.spec.speculative == "eagle"
    if not eagle or config.serving.draft != "remote" or config.role != "decode":
        return ""
    import time

    deadline = time.monotonic() + timeout_s
    async with Registry(config.service.etcd, config.service.cluster) as registry:
        while time.monotonic() < deadline:
            drafts = await registry.list_workers("draft")
            if drafts:
                return drafts[0].grpc_address
            await asyncio.sleep(0.5)
    raise RuntimeError(f"no draft service registered in etcd within {timeout_s:.0f}s")


def _precision(config: EngineConfig) -> dict[str, str]:
    """What a worker advertises of its weights (etcd `extra`, shown by `kvmesh status`)."""
    extra = {"weights": config.load.weights, "compute_dtype": config.compute_dtype}
    if config.int4 is not None:
        extra["int4_group_size"] = str(config.int4.group or "auto")
        extra["int4_embeddings"] = "on" if config.int4.embeddings else "off"
    return extra
