"""Runs a prefill or decode worker process: engine thread, transfer engine, gRPC server,
Prometheus endpoint, etcd registration with keep-alive, a drain on SIGTERM/SIGINT (NOT_SERVING,
lease revoked, new requests refused, those in flight given --drain-timeout to finish)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from kvmesh import event_loop
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.engine_thread import build_engine
from kvmesh.engine.faults import KINDS as FAULT_KINDS
from kvmesh.engine.loader.memory import process_memory_mib
from kvmesh.mesh import addresses, metrics
from kvmesh.mesh.affinity import lead_cpu_setup
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.draft_client import RemoteProposer
from kvmesh.mesh.grpc_server import start_server
from kvmesh.mesh.ports import free_port
from kvmesh.mesh.request_gate import RequestGate
from kvmesh.mesh.store_link import StoreLink, StoreLinkOptions
from kvmesh.mesh.transfer import KvTransferEngine, TransferConfig
from kvmesh.processes import wait_for_signal

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # "prefill" | "decode"
    etcd: str  # host:port
    cluster: str = "default"
    worker_id: str = ""
    host: str = "127.0.0.1"  # where it listens (0.0.0.0: every interface)
    advertise_host: str = ""  # what peers dial (etcd, the transfer engine); "": host
    port: int = 0
    metrics_port: int = 0
    delivery_port: int = 0  # decode: its delivery socket (0: a free port)
    model: str = "smollm2-135m"
    dtype: str = "auto"
    weights: str = "auto"  # auto | fp32 | bf16 | int4 (advertised in the etcd registration)
    int4_group_size: int = 0
    int4_embeddings: bool = False
    kv_dtype: str = "auto"
    kv_cache_bytes: int = 512 << 20
    kv_hugepages: bool = False  # the page pool on 2 MiB hugepages
    kv_integrity: bool = True
    kv_integrity_action: str = "recompute"
    max_num_seqs: int = 64
    tensor_parallel_size: int = 1  # rank processes the engine's model is split over
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    protocol: str = "tcp"
    rdma_devices: str = ""  # protocol rdma: NIC names ("": the transfer engine finds them)
    ttl: int = 5
    local_prefill_tokens: int = 0
    speculative: str = "none"  # decode: none | ngram | eagle (prefill: eagle hands the window)
    num_speculative_tokens: int = 4
    speculative_policy: str = "adaptive"  # adaptive | fixed
    decode_step: str = "fused"  # fused | eager | compiled
    draft: str = "local"  # eagle: "local" head in-process or "remote" draft service (etcd)
    draft_model: str = ""
    use_kvstore: bool = True  # pull/push pages from/to a KV store registered in etcd, if any
    max_queued_requests: int = 256  # requests held at once (running, waiting, prefilling)
    drain_timeout: float = 30.0  # SIGTERM: seconds the requests in flight get to finish

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        self.transfer_config()  # the addresses and the NICs checked now, not once loaded

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(protocol=self.protocol, device=self.rdma_devices,
                              hostname=addresses.advertised(self.host, self.advertise_host, True))  # fmt: skip


@dataclass(frozen=True)
class WorkerParts:
    """What a service needs to build its servicer."""

    options: WorkerOptions
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
    options: WorkerOptions, make_servicers: ServicerFactory, delivery: Listener | None = None
) -> int:
    """Serve until SIGTERM / SIGINT (exit code 0) or until the engine is lost (1: a
    tensor-parallel rank died; the worker goes down whole, its lease revoked first)."""
    worker_id = options.worker_id or f"{options.role}-{uuid.uuid4().hex[:8]}"
    structlog.contextvars.bind_contextvars(service=options.role, worker_id=worker_id)
    draft_address = await _draft_address(options)
    engine = build_engine(
        lambda: Engine(  # on a thread of its own: see AsyncEngine
            EngineConfig(
                model=options.model,
                dtype=options.dtype,
                weights=options.weights,
                int4_group_size=options.int4_group_size,
                int4_embeddings=options.int4_embeddings,
                kv_cache_bytes=options.kv_cache_bytes,
                kv_dtype=options.kv_dtype,
                kv_hugepages=options.kv_hugepages,
                kv_integrity=options.kv_integrity,
                kv_integrity_action=options.kv_integrity_action,
                speculative=options.speculative,
                num_speculative_tokens=options.num_speculative_tokens,
                speculative_policy=options.speculative_policy,
                decode_step=options.decode_step,
                draft_model=options.draft_model or None,
                max_num_seqs=options.max_num_seqs,
                tensor_parallel_size=options.tensor_parallel_size,
                enable_expert_parallel=options.enable_expert_parallel,
                pipeline_parallel_size=options.pipeline_parallel_size,
            ),
            RemoteProposer(draft_address) if draft_address else None,
        )
    )
    engine.on_integrity_failure = lambda _: metrics.KV_INTEGRITY_FAILURES.labels(options.role).inc()
    if engine.faults is not None:
        log.warning("worker.fault_injection_on", faults=dict(engine.faults.plan.every))
        engine.faults.on_inject = lambda kind: metrics.FAULTS_INJECTED.labels(
            options.role, kind
        ).inc()
    if engine.speculator is not None:
        engine.speculator.stats.listener = _spec_metrics(options.role)
    async_engine = AsyncEngine(engine, lead_cpu_setup())  # a lead CPU, where set
    async_engine.start()
    transfer = KvTransferEngine(options.transfer_config())
    public = transfer.config.hostname  # what peers dial (--advertise-host, else --host)
    region = engine.kv_pages.region  # every rank's pages (tensor parallelism: shared memory)
    transfer.register(region.data_ptr(), region.numel())
    transfer.register(engine.kv_cache.tags.data_ptr(), engine.kv_cache.tags.numel() * 4)
    store = None
    if options.use_kvstore:
        store = StoreLink(StoreLinkOptions(options.etcd, options.cluster), async_engine, transfer,
                          options.role)  # fmt: skip
    store_task = asyncio.create_task(store.run()) if store else None
    gate = RequestGate(options.max_queued_requests,
                       metrics.REQUESTS_IN_FLIGHT.labels(options.role).set)  # fmt: skip
    parts = WorkerParts(options, worker_id, async_engine, transfer, engine.kv_dtype, store, gate)
    metrics_port = options.metrics_port or free_port()
    metrics.serve_metrics(metrics_port, options.host)
    metrics.KV_CAPACITY_TOKENS.labels(options.role).set(engine.kv_cache.capacity_tokens)
    metrics.init_series(options.role, fault_kinds=FAULT_KINDS)
    # gRPC is served only once the engine above is loaded, so SERVING from its first answer is
    # true. Serving earlier (a faster cold start) must pass serving=False and set it when loaded.
    server, port, health = await start_server(make_servicers(parts), options.host, options.port)
    delivery_address = ""
    if delivery is not None:
        delivery_port = await delivery.start(options.host, options.delivery_port)
        delivery_address = addresses.host_port(public, delivery_port)
    info = WorkerInfo(
        role=options.role,
        worker_id=worker_id,
        grpc_address=addresses.host_port(public, port),
        metrics_address=addresses.host_port(public, metrics_port),
        te_session=transfer.session,
        delivery_address=delivery_address,
        model=engine.model_name,
        page_size=engine.config.page_size,
        kv_dtype=engine.kv_dtype,
        capacity_tokens=engine.kv_cache.capacity_tokens,
        extra={
            **_precision(engine.config),
            "architecture": engine.model_config.architecture,
            "kv_spec": engine.kv_pages.spec.layout_key,
            "tensor_parallel": str(engine.config.tensor_parallel_size),
            "pipeline_parallel": str(engine.config.pipeline_parallel_size),
            "ranks": _ranks(engine),
        },  # fmt: skip
    )
    lost = False
    try:
        async with Registry(options.etcd, options.cluster) as registry:
            registration = await registry.register(info, ttl=options.ttl)
            log.info("worker.ready", grpc=info.grpc_address, metrics=info.metrics_address)
            event_loop.freeze_heap()
            lost = await _until_stopped_or_lost(async_engine)
            await health.shutdown()  # NOT_SERVING from now on
            with contextlib.suppress(TimeoutError):  # a hung etcd: the lease expires instead
                await asyncio.wait_for(registration.close(), 2.0)  # routers drop us now
            if not lost:
                await gate.drain(options.drain_timeout)  # the rest migrate when the server stops
    finally:
        await health.shutdown()
        if store_task is not None:
            store_task.cancel()
        await server.stop(grace=2)
        if delivery is not None:
            delivery.close()
        async_engine.stop()
        engine.close()  # a tensor-parallel engine's other ranks
        transfer.close()
    return 1 if lost else 0


async def _until_stopped_or_lost(engine: AsyncEngine) -> bool:
    """Wait for a stop signal or for the engine to be lost; True if lost. A lost engine's
    requests in flight have failed (the pass that found it failed them, or the next one)."""
    signal = asyncio.create_task(wait_for_signal())
    lost = asyncio.create_task(engine.lost())
    done, pending = await asyncio.wait((signal, lost), return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if lost in done:
        log.error("worker.engine_lost", reason="a tensor-parallel rank of this worker is gone")
        return True
    return False


def _ranks(engine: Engine) -> str:
    """Each rank's process, device and resident memory after load (`kvmesh status`), JSON."""
    pids = [os.getpid(), *engine.rank_pids]
    return json.dumps([{"rank": r, "pid": pid, "device": "cpu", **process_memory_mib(pid)}
                       for r, pid in enumerate(pids)])  # fmt: skip


def _spec_metrics(role: str):
    def record(drafted: int, emitted: int) -> None:
        metrics.SPEC_DRAFT_TOKENS.labels(role).inc(drafted)
        metrics.SPEC_ACCEPTED_TOKENS.labels(role).inc(emitted - 1)
        metrics.SPEC_ACCEPT_LENGTH.labels(role).observe(emitted)

    return record


async def _draft_address(options: WorkerOptions, timeout_s: float = 120.0) -> str:
    """With --draft remote on a decode worker: the grpc address of a draft service in etcd."""
    if options.speculative != "eagle" or options.draft != "remote" or options.role != "decode":
        return ""
    import time

    deadline = time.monotonic() + timeout_s
    async with Registry(options.etcd, options.cluster) as registry:
        while time.monotonic() < deadline:
            drafts = await registry.list_workers("draft")
            if drafts:
                return drafts[0].grpc_address
            await asyncio.sleep(0.5)
    raise RuntimeError(f"no draft service registered in etcd within {timeout_s:.0f}s")


def _precision(config: EngineConfig) -> dict[str, str]:
    """What a worker advertises of its weights (etcd `extra`, shown by `kvmesh status`)."""
    extra = {"weights": config.weights, "compute_dtype": config.compute_dtype}
    if config.int4 is not None:
        extra["int4_group_size"] = str(config.int4.group or "auto")
        extra["int4_embeddings"] = "on" if config.int4.embeddings else "off"
    return extra
