"""A prefill or decode worker's config tree: its engine, where it serves (etcd, addresses,
ports) and how (request bound, drain, transfer protocol, local prefill, draft placement).
`kvmesh serve prefill|decode` gets its flags from it; `kvmesh up` writes one per child."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.engine import EngineConfig
from kvmesh.config.knobs import check, knob, section
from kvmesh.config.placement import Placed, Placement
from kvmesh.errors import InvalidRequestError

ROLES = ("prefill", "decode")
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class ServiceConfig(Placement):
    """Where a worker runs and registers (`kvmesh up` fills these in for its children)."""

    worker_id: str = knob("", "this worker's name in etcd (default: role and a random suffix)")
    advertise_host: str = knob(
        "",
        "address peers dial, in the etcd registration and the "
        "transfer engine's session (default: --host)",
    )
    port: int = knob(0, "gRPC port (0: a free one)", bounds=(0, 65535))
    metrics_port: int = knob(0, "Prometheus port (0: a free one)", bounds=(0, 65535))
    delivery_port: int = knob(
        0, "decode: the delivery socket's port (0: a free one)", bounds=(0, 65535)
    )
    lease_ttl: int = knob(
        5, "seconds the etcd registration outlives a silent worker", bounds=(1, 300)
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class ServingConfig:
    """How a worker takes requests and moves pages."""

    max_queued_requests: int = knob(
        256,
        "requests a worker holds at once (running, waiting, "
        "prefilling); past it a request is refused as overloaded and "
        "the gateway tries another worker or answers 429 (0: no "
        "bound)",
        bounds=(0, None),
    )
    drain_timeout: float = knob(
        30.0,
        "on SIGTERM: seconds the requests in flight get to finish (the rest migrate)",
        bounds=(0, None),
    )
    local_prefill_tokens: int = knob(
        0, "decode prefills prompts up to this many tokens itself", bounds=(0, None)
    )
    draft: str = knob(
        "local",
        "EAGLE head in the decode process, or on the draft service found in etcd",
        choices=("local", "remote"),
    )
    protocol: str = knob("tcp", "transfer engine protocol", choices=PROTOCOLS)
    rdma_devices: str = knob(
        "",
        "--protocol rdma: the RDMA NICs to use, e.g. mlx5_0,mlx5_1 "
        "(default: the transfer engine finds them)",
        metavar="NICS",
    )
    use_kvstore: bool = knob(
        True, "pull/push pages from/to a KV store registered in etcd, if any", style="on_off"
    )

    def __post_init__(self) -> None:
        check(self)
        if self.rdma_devices and self.protocol != "rdma":
            raise InvalidRequestError(f"--rdma-devices {self.rdma_devices} needs --protocol rdma")


@dataclass(frozen=True)
class WorkerConfig(Placed):
    role: str = "decode"  # the command's (serve prefill | serve decode), not a flag
    engine: EngineConfig = section(EngineConfig)
    service: ServiceConfig = section(ServiceConfig)
    serving: ServingConfig = section(ServingConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequestError(f"role must be prefill or decode, got {self.role!r}")
