"""An asyncio gRPC server with health checking and reflection, bound to loopback by default."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.mesh import tls
from kvmesh.mesh.addresses import host_port

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# Clients ping every 10 s even when idle; gRPC servers by default answer more than two pings
# without data within 5 min with GOAWAY "too_many_pings", which fails the next call on that
# channel (seen as a decode -> prefill call failing after a quiet spell). Accept them.
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthStatus:
    """A server's grpc.health.v1 answers: one status for the server ("") and each service."""

    def __init__(self, servicer: health.aio.HealthServicer, names: list[str]) -> None:
        self.servicer = servicer
        self._names = [*names, ""]
        self.serving: bool | None = None  # None until first set
        self._stopping = False

    async def set_serving(self, serving: bool) -> None:
        if serving == self.serving or self._stopping:
            return
        status = _SERVING if serving else _NOT_SERVING
        for name in self._names:
            await self.servicer.set(name, status)
        self.serving = serving

    async def shutdown(self) -> None:
        """NOT_SERVING for good (the server is stopping); later `set_serving` calls are no-ops."""
        self._stopping = True
        await self.servicer.enter_graceful_shutdown()
        self.serving = False


async def start_server(
    add_servicers: Iterable[Callable[[grpc.aio.Server], str]],
    host: str,
    port: int,
    serving: bool = True,
    client_certs: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int, HealthStatus]:
    """Each callable registers one servicer and returns its full service name. `serving`: the
    first health status (False: NOT_SERVING until the caller's `set_serving(True)`). With TLS
    configured (mesh/tls.py) it listens with TLS, asking callers for a certificate of the mesh's
    CA unless `client_certs` is False (a front for clients)."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))
    names = [add(server) for add in add_servicers]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    status = HealthStatus(health_servicer, names)
    await status.set_serving(serving)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    files, address = tls.current(), host_port(host, port)
    if files is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, files.server_credentials(client_certs))
    await server.start()
    return server, bound, status


def channel(address: str) -> grpc.aio.Channel:
    """A channel to another service (TLS with this process's certificate when configured)."""
    files = tls.current()
    if files is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, files.channel_credentials(), options=CHANNEL_OPTIONS)


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as a time.monotonic() value; None when the caller set none."""
    left = context.time_remaining()
    return None if left is None or left > 1e9 else time.monotonic() + left
