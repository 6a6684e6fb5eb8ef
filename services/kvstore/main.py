"""The KV store process: transfer engine + store, gRPC server, Prometheus endpoint, etcd
registration (role "kvstore") with keep-alive, graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import replace
from pathlib import Path

import structlog

from kvmesh.config.kvstore import KVStoreConfig, PageLayout
from kvmesh.errors import InvalidRequestError
from kvmesh.mesh import addresses
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.kvstore_client import layout_key
from kvmesh.mesh.service_runtime import Listen, Served, serve_registered, stop_on_signals
from kvmesh.mesh.transfer import KvTransferEngine, TransferConfig
from services.kvstore.server import KVStoreServicer, StoreMetrics, add_to
from services.kvstore.store import KVStore, StoreConfig

log = structlog.get_logger(__name__)

_SWEEP_S = 1.0


def checked(config: KVStoreConfig) -> KVStoreConfig:
    """A config a store can start with (`kvmesh serve kvstore` checks it before anything)."""
    if config.layout.page_bytes is None and not config.service.etcd:
        raise InvalidRequestError(
            "a KV store takes its page layout from the workers in etcd (--etcd) or from "
            "--page-bytes (and --kv-dtype, --kv-spec)"
        )
    transfer_config(config)  # the addresses
    return config


def transfer_config(config: KVStoreConfig) -> TransferConfig:
    """The transfer engine's settings (a wildcard --host needs --advertise-host)."""
    service = config.service
    hostname = addresses.advertised(service.host, service.advertise_host, True)
    return TransferConfig(
        protocol=config.transfer.protocol, device=config.transfer.rdma_devices, hostname=hostname
    )


def store_config(config: KVStoreConfig) -> StoreConfig:
    layout, tiers = config.layout, config.tiers
    assert layout.page_bytes is not None, "the layout is adopted first"
    return StoreConfig(
        layout_key=layout_key(layout.model, layout.page_size, layout.kv_dtype, layout.kv_spec),
        page_bytes=layout.page_bytes,
        ram_bytes=tiers.ram_mib << 20,
        disk_bytes=tiers.disk_mib << 20,
        disk_dir=Path(tiers.disk_dir) if tiers.disk_dir else None,
        lease_s=tiers.lease_s,
        reservation_s=tiers.reservation_s,
        backend=tiers.backend,
        mooncake_master=tiers.mooncake_master,
    )


async def serve_kvstore(config: KVStoreConfig, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set)."""
    service = config.service
    worker_id = service.worker_id or f"kvstore-{uuid.uuid4().hex[:8]}"
    structlog.contextvars.bind_contextvars(service="kvstore", worker_id=worker_id)
    stop = stop or asyncio.Event()
    if config.layout.page_bytes is None:
        with stop_on_signals(stop):
            adopted = await _adopt_layout(config, stop)
        if adopted is None:
            return  # stopped before any worker registered
        config = adopted
    transfer = KvTransferEngine(transfer_config(config))
    store = KVStore(store_config(config), transfer)
    listen = Listen(
        "kvstore",
        worker_id,
        service.host,
        transfer.config.hostname,
        service.port,
        service.metrics_port,
        service.etcd,
        service.cluster,
        service.lease_ttl,
    )
    sweeper = asyncio.create_task(_sweep(store))
    try:
        await serve_registered(
            listen,
            [add_to(KVStoreServicer(store))],
            lambda served: _worker_info(config.layout, worker_id, served, store),
            stop=stop,
            collectors=[StoreMetrics(store)],
        )
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        store.close()
        transfer.close()


async def _adopt_layout(config: KVStoreConfig, stop: asyncio.Event) -> KVStoreConfig | None:
    """The page layout of the first prefill or decode worker registered in etcd (each registers
    its model, page size, KV dtype, KV spec key and page bytes); None if stopped first."""
    service = config.service
    log.info("kvstore.waiting_for_a_worker", etcd=service.etcd)
    async with Registry(service.etcd, service.cluster) as registry:
        while not stop.is_set():
            for worker in await registry.list_workers():
                if worker.role in ("prefill", "decode") and "page_bytes" in worker.extra:
                    model, page_size, kv_dtype, kv_spec = worker.kv_layout
                    log.info(
                        "kvstore.layout_adopted",
                        worker=worker.worker_id,
                        model=model,
                        kv_dtype=kv_dtype,
                        kv_spec=kv_spec,
                    )
                    layout = PageLayout(
                        int(worker.extra["page_bytes"]), model, page_size, kv_dtype, kv_spec
                    )
                    return replace(config, layout=layout)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    return None


def _worker_info(layout: PageLayout, worker_id: str, served: Served, store: KVStore) -> WorkerInfo:
    config = store.config
    return WorkerInfo(
        role="kvstore",
        worker_id=worker_id,
        grpc_address=served.grpc,
        metrics_address=served.metrics,
        te_session=store.te_session,
        model=layout.model,
        page_size=layout.page_size,
        kv_dtype=layout.kv_dtype,
        capacity_tokens=(config.ram_pages + config.disk_pages) * layout.page_size,
        extra={
            "layout_key": config.layout_key,
            "page_bytes": config.page_bytes,
            "ram_pages": config.ram_pages,
            "disk_pages": config.disk_pages,
        },
    )


async def _sweep(store: KVStore) -> None:
    while True:
        await asyncio.sleep(_SWEEP_S)
        await asyncio.to_thread(store.sweep)
