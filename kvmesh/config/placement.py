"""Where a service finds the mesh and listens: the knobs every service of it shares."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvmesh.config.knobs import check, knob
from kvmesh.errors import InvalidRequestError


@dataclass(frozen=True)
class Placement:
    etcd: str = knob("", "etcd endpoint host:port or https://host:port")
    cluster: str = knob("default", "the mesh's name: its services' key prefix in etcd")
    host: str = knob("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    tls_cert: str = knob(
        "",
        "this service's certificate: TLS on its gRPC (and the gateway's "
        "REST) port, mutual TLS to the other services (with --tls-key, "
        "--tls-ca; default $KVMESH_TLS_CERT)",
        metavar="PEM",
    )
    tls_key: str = knob("", "its private key (default $KVMESH_TLS_KEY)", metavar="PEM")
    tls_ca: str = knob(
        "",
        "the CA every other service's certificate must chain to (default $KVMESH_TLS_CA)",
        metavar="PEM",
    )
    etcd_ca: str = knob(
        "", "CA of etcd's certificate, for an https:// --etcd (default: --tls-ca)", metavar="PEM"
    )
    etcd_cert: str = knob(
        "", "client certificate shown to etcd (default: --tls-cert)", metavar="PEM"
    )
    etcd_key: str = knob("", "its private key", metavar="PEM")
    etcd_user: str = knob("", "etcd user (authentication on); password in $KVMESH_ETCD_PASSWORD")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Registered(Placement):
    """A service that registers in etcd (a worker, the KV store, the draft service)."""

    worker_id: str = knob("", "its name in etcd (default: its role and a random suffix)")
    advertise_host: str = knob(
        "",
        "address peers dial, in the etcd registration and the "
        "transfer engine's session (default: --host)",
    )
    port: int = knob(0, "gRPC port (0: a free one)", bounds=(0, 65535))
    metrics_port: int = knob(0, "Prometheus port (0: a free one)", bounds=(0, 65535))
    lease_ttl: int = knob(
        5, "seconds its etcd registration outlives it when it goes silent", bounds=(1, 300)
    )


PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class TransferKnobs:
    """The Mooncake transfer engine of a worker or the KV store."""

    protocol: str = knob("tcp", "transfer engine protocol", choices=PROTOCOLS)
    rdma_devices: str = knob(
        "",
        "--protocol rdma: the RDMA NICs to use, e.g. mlx5_0,mlx5_1 "
        "(default: the transfer engine finds them)",
        metavar="NICS",
    )

    def __post_init__(self) -> None:
        check(self)
        if self.rdma_devices and self.protocol != "rdma":
            raise InvalidRequestError(f"--rdma-devices {self.rdma_devices} needs --protocol rdma")


class Placed:
    """A tree with a `service` section (a Placement): `kvmesh up` places each child with it."""

    service: Placement

    def placed(self: Any, **service: object) -> Any:
        """This config with service knobs set (etcd, worker_id, ports, ...)."""
        return replace(self, service=replace(self.service, **service))
