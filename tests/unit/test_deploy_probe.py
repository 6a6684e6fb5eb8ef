"""The images' health check (`python -m kvmesh_apps.deploy.probe`) against services with and without
TLS: with $KVMESH_TLS_* it dials TLS (mutual for gRPC) and checks the CA; a wrong certificate
or plaintext to a TLS port is "not ready"."""

from __future__ import annotations

import http.server
import ssl
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.mesh.certs import make_ca, make_leaf
from kvmesh_apps.deploy import probe


@pytest.fixture
def pki(tmp_path):
    ca = make_ca(tmp_path / "a")
    other = make_ca(tmp_path / "b")
    return make_leaf(tmp_path / "a", "service", ca), make_leaf(tmp_path / "b", "stranger", other)


def _use(monkeypatch, files) -> None:
    for name, path in zip(
        ("KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA"),
        (files.cert, files.key, files.ca),
        strict=True,
    ):
        monkeypatch.setenv(name, str(path))


def test_grpc_probe_speaks_mutual_tls(pki, monkeypatch):
    service, stranger = pki
    server = grpc.server(futures.ThreadPoolExecutor(2))
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_secure_port("127.0.0.1:0", service.server_credentials(client_certs=True))
    server.start()
    try:
        assert not probe.ready("grpc", port, "127.0.0.1")  # plaintext to a TLS port
        _use(monkeypatch, service)
        assert probe.ready("grpc", port, "127.0.0.1")
        checker.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not probe.ready("grpc", port, "127.0.0.1")
        checker.set("", health_pb2.HealthCheckResponse.SERVING)
        _use(monkeypatch, stranger)  # another CA: neither side trusts the other
        assert not probe.ready("grpc", port, "127.0.0.1")
    finally:
        server.stop(None)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_http_probe_speaks_tls(pki, monkeypatch):
    service, stranger = pki
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(service.cert), str(service.key))
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        assert not probe.ready("http", port, "127.0.0.1")  # plain http to an https port
        _use(monkeypatch, service)
        assert probe.ready("http", port, "127.0.0.1")
        _use(monkeypatch, stranger)  # the service's certificate is not from this CA
        assert not probe.ready("http", port, "127.0.0.1")
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("command", [("serve", "decode"), ("serve", "kvstore"), ("status",)])
def test_tls_flags_default_to_the_environment(pki, monkeypatch, command):
    from kvmesh.cli_args import build_parser

    service, _ = pki
    _use(monkeypatch, service)
    argv = list(command)
    args = build_parser(argv).parse_args(argv)
    assert (args.tls_cert, args.tls_key, args.tls_ca) == tuple(
        str(p) for p in (service.cert, service.key, service.ca)
    )
    argv += ["--tls-cert", "/x"]
    assert build_parser(argv).parse_args(argv).tls_cert == "/x"  # a flag wins
