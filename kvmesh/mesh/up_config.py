"""The worker configs `kvmesh up` starts: from its flags (`up_workers`), or from the flags of
`kvmesh serve ROLE` (`worker_configs`, for scripts and tests). Each child gets its config as a
file (launcher.py); where it runs (etcd, its id) is filled in when it is started."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.config import EngineConfig, ServingConfig, WorkerConfig
from kvmesh.config.flags import from_namespace, parse_flags
from kvmesh.config.gateway import GatewayConfig
from kvmesh.config.knobs import build, flat
from kvmesh.config.kvstore import KVStoreConfig, Tiers
from kvmesh.config.placement import TransferKnobs
from kvmesh.config.up import MeshConfig, RoleOverrides
from kvmesh.config.worker import ROLES
from kvmesh.errors import LaunchError
from kvmesh.routing import UP_LOCAL_PREFILL_TOKENS


def _default_workers() -> dict[str, WorkerConfig]:
    return {role: WorkerConfig(role) for role in ROLES}


@dataclass(frozen=True)
class UpOptions:
    # each role's worker config (up_config.py); the etcd and id of each worker filled at start
    workers: Mapping[str, WorkerConfig] = field(default_factory=_default_workers)
    prefill: int = MeshConfig.prefill  # defaults: the knobs' (config/up.py)
    decode: int = MeshConfig.decode
    http_port: int | None = MeshConfig.http_port
    grpc_port: int | None = MeshConfig.grpc_port
    cluster: str = MeshConfig.cluster
    # CPU list per role, e.g. {"prefill": "0"} (else KVMESH_<ROLE>_CPUS): see mesh/affinity.py
    role_cpus: dict[str, str] = field(default_factory=dict)
    # the gateway's config (up_config.py); its model the workers', where it runs set at start
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    kvstore: str = "none"  # (not the flag's: a test's mesh starts none unless it says so)
    store: KVStoreConfig = field(default_factory=KVStoreConfig)  # its tiers (up_config.py)
    ready_timeout: float = 180.0
    decode_lead_cpu: str = MeshConfig.decode_lead_cpu  # see affinity.decode_lead_cpu
    tls: bool = MeshConfig.tls  # TLS everywhere, with a throwaway CA made in the run's directory
    precision: str = ""  # the banner's line on the precision `up` chose (up_config.py)

    @property
    def model(self) -> str:
        """The mesh's one model (the gateway's, the KV store's, the draft service's)."""
        return self.workers["decode"].engine.load.model

    def __post_init__(self) -> None:
        if {w.engine.load.model for w in self.workers.values()} != {self.model}:
            raise LaunchError("every worker of one mesh serves the same --model")


def worker_configs(
    *flags: str, prefill: Sequence[str] = (), decode: Sequence[str] = ()
) -> dict[str, WorkerConfig]:
    """Each role's config from `kvmesh serve ROLE` flags: the common ones, then the role's."""
    own = {"prefill": prefill, "decode": decode}
    return {role: parse_flags(WorkerConfig, [*flags, *own[role]], role=role) for role in ROLES}


def gateway_config(*flags: str) -> GatewayConfig:
    """The gateway's config from `kvmesh serve gateway` flags."""
    return parse_flags(GatewayConfig, flags)


def kvstore_config(*flags: str) -> KVStoreConfig:
    """The KV store's config from `kvmesh serve kvstore` flags (its layout: the workers')."""
    return parse_flags(KVStoreConfig, flags)


def up_gateway(args: argparse.Namespace) -> GatewayConfig:
    """`kvmesh up`'s flags as its gateway's config (the model: the workers')."""
    return from_namespace(GatewayConfig, args, model=args.model)


def up_workers(args: argparse.Namespace) -> dict[str, WorkerConfig]:
    """`kvmesh up`'s flags as each role's config, its role-dependent defaults settled:
    per-role precisions (--prefill-weights / --decode-weights) exchange bf16 KV and prefill
    every prompt on the prefill workers; otherwise decode prefills short prompts itself."""
    per_role = bool(args.prefill_weights or args.decode_weights)
    common = flat(from_namespace(EngineConfig, args))
    if per_role and common["kv_dtype"] == "auto":
        common["kv_dtype"] = "bf16"  # one KV format both roles can exchange
    local = args.local_prefill_tokens
    if local is None:
        local = 0 if per_role else UP_LOCAL_PREFILL_TOKENS
    serving = from_namespace(ServingConfig, args, local_prefill_tokens=local)
    transfer = from_namespace(TransferKnobs, args)
    configs = {}
    for role in ROLES:
        own = from_namespace(RoleOverrides, args, prefix=role)
        given = {
            "weights": own.weights,
            "tensor_parallel_size": own.tp,
            "pipeline_parallel_size": own.pp,
        }
        engine = build(EngineConfig, **(common | {k: v for k, v in given.items() if v}))
        configs[role] = WorkerConfig(role, engine, serving=serving, transfer=transfer)
    return configs


def settle_precision(args: argparse.Namespace) -> str:
    """With no precision flag, `up` serves in the fastest exact-enough one (precision.py),
    settled into args here; what it is, for the banner ("" when flags chose)."""
    named = args.dtype != "auto" or args.weights != "auto"
    if named or args.prefill_weights or args.decode_weights:
        return ""
    from kvmesh.mesh.precision import serving_precision

    chosen = serving_precision(args.model)
    args.dtype, args.weights = chosen.dtype, chosen.weights
    return f"{chosen.why} (the default; --dtype fp32 for fp32)"


def up_options(args: argparse.Namespace) -> UpOptions:
    """`kvmesh up`'s flags as the launcher's options (`kvmesh config show up` reads them too)."""
    precision = settle_precision(args)
    mesh = from_namespace(MeshConfig, args)
    return UpOptions(
        workers=up_workers(args),
        prefill=mesh.prefill,
        decode=mesh.decode,
        http_port=mesh.http_port,
        grpc_port=mesh.grpc_port,
        cluster=mesh.cluster,
        gateway=up_gateway(args),
        kvstore=mesh.kvstore,
        decode_lead_cpu=mesh.decode_lead_cpu,
        tls=mesh.tls,
        precision=precision,
        store=KVStoreConfig(tiers=from_namespace(Tiers, args, prefix="kvstore")),
    )
