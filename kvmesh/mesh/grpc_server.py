"""An asyncio gRPC server with health checking and reflection, bound to loopback by default."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

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


async def start_server(
    add_servicers: Iterable[Callable[[grpc.aio.Server], str]], host: str, port: int
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Each callable registers one servicer and returns its full service name."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    names = [add(server) for add in add_servicers]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in [*names, ""]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound, health_servicer


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
