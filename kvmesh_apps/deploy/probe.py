"""A container's health check: `python -m kvmesh_apps.deploy.probe grpc|http|tcp PORT` exits 0 when
the service on PORT is ready -- gRPC: `grpc.health.v1` says SERVING; http: /health is 200; tcp:
it accepts. The host is $KVMESH_PROBE_HOST, else $POD_IP, else 127.0.0.1 (where it listens); the
port $KVMESH_PROBE_PORT when set (a container given other ports by its flags). With TLS
($KVMESH_TLS_CERT / _KEY / _CA, the defaults of the service's --tls-* flags) the probe speaks
TLS with that certificate (mutual TLS for gRPC) and checks the service's against the CA;
$KVMESH_PROBE_TLS_NAME names the certificate's host when it is not the address dialed."""

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
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with _grpc_channel(f"{address}:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S
                )
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if kind == "http":
            context = _ssl_context()
            scheme = "https" if context else "http"
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
            )
            with opener.open(f"{scheme}://{address}:{port}/health", timeout=TIMEOUT_S) as resp:
                return resp.status == 200
        with socket.create_connection((address, port), timeout=TIMEOUT_S):
            return True
    except Exception:  # noqa: BLE001 -- any failure is "not ready"
        return False


def _tls():
    from kvmesh import env
    from kvmesh.mesh.tls import TlsFiles

    return TlsFiles.of(*env.tls_paths())


def _grpc_channel(target: str):
    import grpc

    files = _tls()
    if files is None:
        return grpc.insecure_channel(target)
    name = os.environ.get("KVMESH_PROBE_TLS_NAME")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(target, files.channel_credentials(), options=options)


def _ssl_context():
    import ssl

    files = _tls()
    if files is None:
        return None
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    if os.environ.get("KVMESH_PROBE_TLS_NAME"):
        context.check_hostname = False  # the chain to the CA is still checked, not the name
    return context


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grpc", "http", "tcp") or not argv[1].isdigit():
        print("usage: python -m kvmesh_apps.deploy.probe grpc|http|tcp PORT", file=sys.stderr)
        return 2
    port = int(os.environ.get("KVMESH_PROBE_PORT") or argv[1])
    return 0 if ready(argv[0], port) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
