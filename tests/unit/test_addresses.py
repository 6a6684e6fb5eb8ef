"""Bind and advertised addresses: a wildcard bind needs --advertise-host, IPv6 literals go in
brackets, the transfer engine refuses IPv6 (Mooncake's handshake), RDMA NICs need rdma."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.config.draft import DraftConfig
from kvmesh.config.knobs import build
from kvmesh.config.kvstore import KVStoreConfig
from kvmesh.errors import InvalidRequestError
from kvmesh.mesh import addresses
from kvmesh.mesh.grpc_server import start_server
from kvmesh.mesh.transfer import TransferConfig
from kvmesh.mesh.worker_runtime import transfer_config
from services.draft.main import check_addresses
from services.kvstore.main import transfer_config as store_transfer


def test_host_port_puts_ipv6_literals_in_brackets():
    assert addresses.host_port("10.0.0.2", 50051) == "10.0.0.2:50051"
    assert addresses.host_port("::1", 50051) == "[::1]:50051"
    assert addresses.host_port("[fd00::2]", 80) == "[fd00::2]:80"
    assert addresses.host_port("decode-0.kvmesh", 9) == "decode-0.kvmesh:9"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_bind_needs_an_advertised_host(host):
    with pytest.raises(ValueError, match="--advertise-host"):
        addresses.advertised(host)
    with pytest.raises(ValueError, match="--advertise-host .* no address a peer can dial"):
        addresses.advertised("10.0.0.2", host or "::")
    assert addresses.advertised(host, "10.0.0.2", transfer=True) == "10.0.0.2"


def test_the_transfer_engine_refuses_ipv6_and_others_take_it():
    with pytest.raises(ValueError, match="IPv4 only"):
        addresses.advertised("::1", transfer=True)
    with pytest.raises(ValueError, match="IPv4 only"):
        addresses.advertised("0.0.0.0", "fd00::2", transfer=True)
    assert addresses.advertised("[::1]") == "::1"  # the draft service has no transfer engine


def test_services_check_their_addresses_when_configured():
    with pytest.raises(ValueError, match="--advertise-host"):
        transfer_config(_worker(host="0.0.0.0"))
    with pytest.raises(ValueError, match="--advertise-host"):
        store_transfer(build(KVStoreConfig, page_bytes=4096, host="0.0.0.0"))
    with pytest.raises(ValueError, match="--advertise-host"):
        check_addresses(build(DraftConfig, host="::"))
    worker = _worker(
        host="0.0.0.0", advertise_host="10.0.0.2", protocol="rdma", rdma_devices="mlx5_0"
    )
    config = transfer_config(worker)
    assert (config.hostname, config.protocol, config.device) == ("10.0.0.2", "rdma", "mlx5_0")
    assert transfer_config(_worker()).hostname == "127.0.0.1"


def _worker(**knobs):
    from kvmesh.config import WorkerConfig
    from kvmesh.config.knobs import build

    return build(WorkerConfig, etcd="127.0.0.1:1", **knobs)


def test_rdma_devices_need_the_rdma_protocol():
    with pytest.raises(ValueError, match="need protocol rdma"):
        TransferConfig(protocol="tcp", device="mlx5_0")
    with pytest.raises(InvalidRequestError, match="needs --protocol rdma"):
        build(KVStoreConfig, page_bytes=4096, rdma_devices="mlx5_0")


def test_serve_refuses_a_wildcard_without_advertise_host_in_one_line():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "serve",
            "decode",
            "--etcd",
            "127.0.0.1:1",
            "--host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "kvmesh serve decode: error:" in done.stderr and "--advertise-host" in done.stderr
    assert "Traceback" not in done.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_grpc_serves_on_an_ipv6_address():
    async def run() -> int:
        server, port, _ = await start_server([], "::1", 0)
        try:
            async with grpc.aio.insecure_channel(addresses.host_port("::1", port)) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                return reply.status
        finally:
            await server.stop(0)

    assert asyncio.run(run()) == health_pb2.HealthCheckResponse.SERVING


def test_up_passes_the_transfer_and_pool_flags_to_workers_that_parse_them():
    from kvmesh.cli_args import build_parser
    from kvmesh.errors import InvalidRequestError
    from kvmesh.mesh.up_config import up_workers

    up = ["up", "--protocol", "rdma", "--rdma-devices", "mlx5_0,mlx5_1", "--kv-hugepages", "on"]
    worker = up_workers(build_parser(up).parse_args(up))["decode"]
    assert (worker.transfer.protocol, worker.transfer.rdma_devices) == ("rdma", "mlx5_0,mlx5_1")
    assert worker.engine.cache.kv_hugepages is True
    alone = ["up", "--rdma-devices", "mlx5_0"]
    with pytest.raises(InvalidRequestError, match="needs --protocol rdma"):
        up_workers(build_parser(alone).parse_args(alone))
