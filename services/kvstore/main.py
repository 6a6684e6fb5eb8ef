"""The KV store process: transfer engine + store, gRPC server, Prometheus endpoint, etcd
registration (role "kvstore") with keep-alive, graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from kvmesh.config.engine import KV_DTYPES
from kvmesh.mesh import addresses, etcd_access, tls
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.kvstore_client import layout_key
from kvmesh.mesh.service_runtime import Listen, Served, serve_registered, stop_on_signals
from kvmesh.mesh.transfer import KvTransferEngine, TransferConfig
from kvmesh.mesh.transfer import add_arguments as add_transfer_arguments
from services.kvstore.server import KVStoreServicer, StoreMetrics, add_to
from services.kvstore.store import KVStore, StoreConfig

log = structlog.get_logger(__name__)

_SWEEP_S = 1.0


@dataclass(frozen=True)
class KVStoreOptions:
    """`etcd` "" = do not register (a standalone store). `disk_dir` "" = a temporary directory
    removed on stop; `disk_mib` 0 = no disk tier. The layout (model, page_size, kv_dtype,
    kv_spec, page_bytes) must equal the workers' or their calls fail with INVALID_ARGUMENT:
    without `page_bytes` the store takes the layout a worker registers in etcd. `backend`
    "mooncake" keeps the second tier (disk_mib) in Mooncake Store behind the master at
    `mooncake_master` (host:port; none is started here)."""

    etcd: str
    page_bytes: int | None = None  # None: the layout of the first worker registered in etcd
    cluster: str = "default"
    worker_id: str = ""
    host: str = "127.0.0.1"  # where it listens (0.0.0.0: every interface)
    advertise_host: str = ""  # what peers dial (etcd, the transfer engine); "": host
    port: int = 0
    metrics_port: int = 0
    model: str = "smollm2-135m"
    page_size: int = 16
    kv_dtype: str = "fp32"
    kv_spec: str = ""  # the workers' KV spec key (kv/layout.py), part of the layout key
    ram_mib: int = 256
    disk_mib: int = 1024
    disk_dir: str = ""
    protocol: str = "tcp"
    rdma_devices: str = ""  # protocol rdma: NIC names ("": the transfer engine finds them)
    ttl: int = 5
    lease_s: float = 30.0
    reservation_s: float = 60.0
    backend: str = "disk"
    mooncake_master: str = ""

    def __post_init__(self) -> None:
        if self.ram_mib <= 0 or self.disk_mib < 0 or self.page_size <= 0:
            raise ValueError("ram_mib and page_size must be > 0, disk_mib >= 0")
        if self.page_bytes is None and not self.etcd:
            raise ValueError(
                "a KV store takes its page layout from the workers in etcd "
                "(--etcd) or from --page-bytes (and --kv-dtype, --kv-spec)"
            )
        if self.page_bytes is not None:
            self.store_config()  # validates the rest
        self.transfer_config()

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            protocol=self.protocol,
            device=self.rdma_devices,
            hostname=addresses.advertised(self.host, self.advertise_host, True),
        )

    @property
    def layout_key(self) -> str:
        return layout_key(self.model, self.page_size, self.kv_dtype, self.kv_spec)

    def store_config(self) -> StoreConfig:
        assert self.page_bytes is not None, "the layout is adopted first"
        return StoreConfig(
            layout_key=self.layout_key,
            page_bytes=self.page_bytes,
            ram_bytes=self.ram_mib << 20,
            disk_bytes=self.disk_mib << 20,
            disk_dir=Path(self.disk_dir) if self.disk_dir else None,
            lease_s=self.lease_s,
            reservation_s=self.reservation_s,
            backend=self.backend,
            mooncake_master=self.mooncake_master,
        )


async def serve_kvstore(options: KVStoreOptions, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set)."""
    worker_id = options.worker_id or f"kvstore-{uuid.uuid4().hex[:8]}"
    structlog.contextvars.bind_contextvars(service="kvstore", worker_id=worker_id)
    stop = stop or asyncio.Event()
    if options.page_bytes is None:
        with stop_on_signals(stop):
            adopted = await _adopt_layout(options, stop)
        if adopted is None:
            return  # stopped before any worker registered
        options = adopted
    transfer = KvTransferEngine(options.transfer_config())
    store = KVStore(options.store_config(), transfer)
    listen = Listen("kvstore", worker_id, options.host, transfer.config.hostname, options.port,
                    options.metrics_port, options.etcd, options.cluster, options.ttl)  # fmt: skip
    sweeper = asyncio.create_task(_sweep(store))
    try:
        await serve_registered(
            listen,
            [add_to(KVStoreServicer(store))],
            lambda served: _worker_info(options, worker_id, served, store),
            stop=stop,
            collectors=[StoreMetrics(store)],
        )
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        store.close()
        transfer.close()


async def _adopt_layout(options: KVStoreOptions, stop: asyncio.Event) -> KVStoreOptions | None:
    """The page layout of the first prefill or decode worker registered in etcd (each registers
    its model, page size, KV dtype, KV spec key and page bytes); None if stopped first."""
    log.info("kvstore.waiting_for_a_worker", etcd=options.etcd)
    async with Registry(options.etcd, options.cluster) as registry:
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
                    return replace(
                        options,
                        model=model,
                        page_size=page_size,
                        kv_dtype=kv_dtype,
                        kv_spec=kv_spec,
                        page_bytes=int(worker.extra["page_bytes"]),
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    return None


def _worker_info(
    options: KVStoreOptions, worker_id: str, served: Served, store: KVStore
) -> WorkerInfo:
    config = store.config
    return WorkerInfo(
        role="kvstore",
        worker_id=worker_id,
        grpc_address=served.grpc,
        metrics_address=served.metrics,
        te_session=store.te_session,
        model=options.model,
        page_size=options.page_size,
        kv_dtype=options.kv_dtype,
        capacity_tokens=(config.ram_pages + config.disk_pages) * options.page_size,
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `kvmesh serve kvstore` (dest names match KVStoreOptions fields)."""
    p.add_argument("--etcd", default="", help="etcd host:port (empty: do not register)")
    tls.add_arguments(p)
    etcd_access.add_arguments(p)
    p.add_argument("--cluster", default="default")
    addresses.add_arguments(p)
    p.add_argument("--worker-id", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument(
        "--page-bytes",
        type=int,
        default=None,
        help="an explicit page layout: bytes per KV page, with --model, --page-size, "
        "--kv-dtype and --kv-spec (default: the layout a worker registers in etcd)",
    )
    p.add_argument("--model", default="smollm2-135m", help="with --page-bytes: the model")
    p.add_argument("--page-size", type=int, default=16, help="with --page-bytes: tokens per page")
    p.add_argument(
        "--kv-dtype",
        default="fp32",
        choices=KV_DTYPES,
        help="with --page-bytes: the pages' KV dtype",
    )
    p.add_argument("--kv-spec", default="", help="with --page-bytes: the KV spec key")
    p.add_argument("--ram-mib", type=int, default=256, help="RAM tier capacity")
    p.add_argument("--disk-mib", type=int, default=1024, help="disk tier capacity (0: none)")
    p.add_argument("--disk-dir", default="", help="disk tier directory (default: temporary)")
    p.add_argument(
        "--backend", default="disk", choices=["disk", "mooncake"], help="second tier's backend"
    )
    p.add_argument(
        "--mooncake-master", default="", help="Mooncake master host:port (backend mooncake)"
    )
    add_transfer_arguments(p)
    p.add_argument("--ttl", type=int, default=5, help="etcd lease TTL (s)")


def options_from_args(args: argparse.Namespace) -> KVStoreOptions:
    names = KVStoreOptions.__dataclass_fields__
    return KVStoreOptions(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m services.kvstore.main --page-bytes N [...]`."""
    from kvmesh import event_loop
    from kvmesh.log import configure_logging

    parser = argparse.ArgumentParser(prog="kvmesh-kvstore")
    add_arguments(parser)
    try:
        options = options_from_args(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging("kvstore", "INFO")
    event_loop.run(serve_kvstore(options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
