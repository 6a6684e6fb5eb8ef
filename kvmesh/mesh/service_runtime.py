"""The one lifecycle of a registered service (prefill, decode, KV store, draft): a Prometheus
endpoint, the gRPC server with health, the etcd registration under a lease, stop signals, and
on stop: NOT_SERVING, the registration revoked (routers drop it), the requests in flight
drained, the server stopped. A service supplies its servicers, how it describes itself in
etcd, and optionally what ends it early (`lost`) and how it drains.

gRPC is served only once the service's engine or store is built (callers build it first), so
SERVING from its first answer is true."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

import structlog
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.registry import Collector

from kvmesh import event_loop
from kvmesh.mesh import addresses
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.grpc_server import start_server
from kvmesh.mesh.ports import free_port

log = structlog.get_logger(__name__)
REVOKE_TIMEOUT_S = 2.0  # a hung etcd: the lease expires instead


@dataclass(frozen=True)
class Listen:
    """Where a service listens and registers."""

    role: str
    worker_id: str
    host: str  # where it listens (0.0.0.0: every interface)
    public: str  # what peers dial (--advertise-host, else --host)
    port: int = 0  # gRPC (0: a free one)
    metrics_port: int = 0
    etcd: str = ""  # "": not registered (a service alone)
    cluster: str = "default"
    lease_ttl: int = 5
    log_as: str = ""  # its "<name>.ready" log event (default: the role)


@dataclass(frozen=True)
class Served:
    """The addresses a running service is reached at (for its WorkerInfo)."""

    grpc: str
    metrics: str


async def serve_registered(
    listen: Listen,
    servicers: Iterable[Callable],
    describe: Callable[[Served], WorkerInfo],
    *,
    stop: asyncio.Event | None = None,
    lost: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    collectors: Iterable[Collector] = (),
) -> bool:
    """Serve until SIGTERM / SIGINT (or `stop` is set): False; or until `lost` returns: True
    (no drain then: what was in flight has failed)."""
    stop = stop or asyncio.Event()
    collectors = list(collectors)
    for collector in collectors:
        REGISTRY.register(collector)
    metrics_port = listen.metrics_port or free_port()
    http, _ = start_http_server(metrics_port, addr=listen.host)
    server, port, health = await start_server(list(servicers), listen.host, listen.port)
    public = listen.public
    info = describe(
        Served(addresses.host_port(public, port), addresses.host_port(public, metrics_port))
    )
    ended_by_loss = False
    try:
        with stop_on_signals(stop):
            async with _registered(listen, info) as registration:
                log.info(
                    f"{listen.log_as or listen.role}.ready",
                    grpc=info.grpc_address,
                    metrics=info.metrics_address,
                    registered=bool(listen.etcd),
                )
                event_loop.freeze_heap()
                ended_by_loss = await _until_stopped_or_lost(stop, lost)
                await health.shutdown()  # NOT_SERVING from now on
                if registration is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(registration.close(), REVOKE_TIMEOUT_S)
                if drain is not None and not ended_by_loss:
                    await drain()  # the rest migrate when the server stops
    finally:
        await health.shutdown()
        await server.stop(grace=2)
        http.shutdown()
        http.server_close()
        for collector in collectors:
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(collector)
    return ended_by_loss


@contextlib.asynccontextmanager
async def _registered(listen: Listen, info: WorkerInfo):
    """The registration under a lease kept alive (None for a service without etcd)."""
    if not listen.etcd:
        yield None
        return
    async with Registry(listen.etcd, listen.cluster) as registry:
        yield await registry.register(info, ttl=listen.lease_ttl)


async def _until_stopped_or_lost(
    stop: asyncio.Event, lost: Callable[[], Awaitable[None]] | None
) -> bool:
    waits = {asyncio.create_task(stop.wait())}
    loss = asyncio.create_task(lost()) if lost is not None else None
    if loss is not None:
        waits.add(loss)
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return loss is not None and loss in done


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` while inside (the handlers removed after)."""
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
