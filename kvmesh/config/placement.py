"""Where a service finds the mesh and listens: the knobs every service of it shares."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvmesh.config.knobs import check, knob


@dataclass(frozen=True)
class Placement:
    etcd: str = knob("", "etcd endpoint host:port or https://host:port")
    cluster: str = knob("default", "the mesh's name: its services' key prefix in etcd")
    host: str = knob("127.0.0.1", "address to listen on (0.0.0.0: every interface)")

    def __post_init__(self) -> None:
        check(self)


class Placed:
    """A tree with a `service` section (a Placement): `kvmesh up` places each child with it."""

    service: Placement

    def placed(self: Any, **service: object) -> Any:
        """This config with service knobs set (etcd, worker_id, ports, ...)."""
        return replace(self, service=replace(self.service, **service))
