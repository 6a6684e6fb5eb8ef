"""A prefill or decode worker's config tree: its engine, where it serves (etcd, addresses,
ports) and how (request bound, drain, transfer protocol, local prefill, draft placement).
`kvmesh serve prefill|decode` gets its flags from it; `kvmesh up` writes one per child."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.engine import EngineConfig
from kvmesh.config.knobs import check, knob, section
from kvmesh.config.placement import Placed, Registered, TransferKnobs
from kvmesh.errors import InvalidRequestError

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ServiceConfig(Registered):
    """Where a worker runs and registers (`kvmesh up` fills these in for its children)."""

    delivery_port: int = knob(
        0, "decode: the delivery socket's port (0: a free one)", bounds=(0, 65535)
    )


@dataclass(frozen=True)
class ServingConfig:
    """How a worker takes requests and moves pages."""

    max_queued_requests: int = knob(
        256,
        "requests a worker holds at once (running, waiting, prefilling); past it a request is "
        "refused as overloaded and the gateway tries another worker or answers 429 (0: no bound)",
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
    use_kvstore: bool = knob(
        True, "pull/push pages from/to a KV store registered in etcd, if any", style="on_off"
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class WorkerConfig(Placed):
    role: str = "decode"  # the command's (serve prefill | serve decode), not a flag
    engine: EngineConfig = section(EngineConfig)
    service: ServiceConfig = section(ServiceConfig)
    serving: ServingConfig = section(ServingConfig)
    transfer: TransferKnobs = section(TransferKnobs)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequestError(f"role must be prefill or decode, got {self.role!r}")
