"""`kvmesh up`'s own knobs: what the local mesh is made of. Each child's config is its own tree
(worker.py, gateway.py, kvstore.py); these say how many, where and with what around them."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.engine import WEIGHTS
from kvmesh.config.knobs import check, knob

KVSTORE_KINDS = ("builtin", "mooncake", "none")


@dataclass(frozen=True)
class MeshConfig:
    prefill: int = knob(1, "prefill workers", bounds=(0, 64))
    decode: int = knob(1, "decode workers", bounds=(1, 64))
    http_port: int | None = knob(None, "the gateway's HTTP port (default: a free one)", parse=int)
    grpc_port: int | None = knob(None, "the gateway's gRPC port (default: a free one)", parse=int)
    cluster: str = knob("default", "the cluster the services register under in etcd")
    kvstore: str = knob(
        "builtin",
        "start the KV store service (RAM + disk tiers; mooncake: RAM + Mooncake Store "
        "via mooncake_master) or run without one",
        choices=KVSTORE_KINDS,
    )
    tls: bool = knob(
        False,
        "TLS everywhere with a throwaway CA made for this run: clients reach the "
        "gateway over https, services use mutual TLS",
        style="switch",
    )
    decode_lead_cpu: str = knob(
        "auto",
        "a CPU the decode worker's engine thread keeps to itself, its OpenMP "
        "team and the gateway on the rest (auto: the last CPU, for one decode worker "
        "without --prefill-cpus/--decode-cpus on 2+ CPUs)",
        metavar="auto|off|CPU",
    )
    demo: bool = knob(False, "run the offline engine on a demo chat instead", style="switch")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class RoleOverrides:
    """One role's workers unlike the other's (flags --prefill-* / --decode-*; None: as
    the engine's own knob says)."""

    weights: str | None = knob(
        None, "weight precision of this role's workers only (default: --weights)", choices=WEIGHTS
    )
    tp: int | None = knob(
        None,
        "tensor parallel size of this role's workers only",
        bounds=(1, 8),
        parse=int,
        metavar="N",
    )
    pp: int | None = knob(
        None,
        "pipeline parallel size of this role's workers only",
        bounds=(1, 8),
        parse=int,
        metavar="N",
    )

    def __post_init__(self) -> None:
        check(self)
