"""A container's health check: `python -m kvmesh.deploy.probe grpc|http|tcp PORT` exits 0 when
the service on PORT is ready -- gRPC: `grpc.health.v1` says SERVING; http: /health is 200; tcp:
it accepts. The host is $KVMESH_PROBE_HOST, else $POD_IP, else 127.0.0.1 (where it binds); the
port $KVMESH_PROBE_PORT when set (a container given other ports by its flags)."""

from __future__ import annotations

import os
import socket
import sys
import urllib.request

TIMEOUT_S = 4.0


def host() -> str:
    return os.environ.get("KVMESH_PROBE_HOST") or os.environ.get("POD_IP") or "127.0.0.1"


def ready(kind: str, port: int, at: str | None = None) -> bool:
    address = at or host()
    try:
        if kind == "grpc":
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with grpc.insecure_channel(f"{address}:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S
                )
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if kind == "http":
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(f"http://{address}:{port}/health", timeout=TIMEOUT_S) as resp:
                return resp.status == 200
        with socket.create_connection((address, port), timeout=TIMEOUT_S):
            return True
    except Exception:  # noqa: BLE001 -- any failure is "not ready"
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grpc", "http", "tcp") or not argv[1].isdigit():
        print("usage: python -m kvmesh.deploy.probe grpc|http|tcp PORT", file=sys.stderr)
        return 2
    port = int(os.environ.get("KVMESH_PROBE_PORT") or argv[1])
    return 0 if ready(argv[0], port) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
