"""The worker configs `kvmesh up` starts: from its flags (`up_workers`), or from the flags of
`kvmesh serve ROLE` (`worker_configs`, for scripts and tests). Each child gets its config as a
file (launcher.py); where it runs (etcd, its id) is filled in when it is started."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.config import EngineConfig, ServingConfig, WorkerConfig
from kvmesh.config.flags import from_namespace, parse_flags
from kvmesh.config.gateway import GatewayConfig
from kvmesh.config.knobs import build, flat
from kvmesh.config.worker import ROLES
from kvmesh.routing import UP_LOCAL_PREFILL_TOKENS

if TYPE_CHECKING:
    from kvmesh.mesh.launcher import UpOptions


def worker_configs(
    *flags: str, prefill: Sequence[str] = (), decode: Sequence[str] = ()
) -> dict[str, WorkerConfig]:
    """Each role's config from `kvmesh serve ROLE` flags: the common ones, then the role's."""
    own = {"prefill": prefill, "decode": decode}
    return {role: parse_flags(WorkerConfig, [*flags, *own[role]], role=role) for role in ROLES}


def gateway_config(*flags: str) -> GatewayConfig:
    """The gateway's config from `kvmesh serve gateway` flags."""
    return parse_flags(GatewayConfig, flags)


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
    configs = {}
    for role in ROLES:
        own = {
            "weights": getattr(args, f"{role}_weights"),
            "tensor_parallel_size": getattr(args, f"{role}_tp"),
            "pipeline_parallel_size": getattr(args, f"{role}_pp"),
        }
        engine = build(EngineConfig, **(common | {k: v for k, v in own.items() if v}))
        configs[role] = WorkerConfig(role, engine, serving=serving)
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
    from kvmesh.mesh.launcher import UpOptions

    precision = settle_precision(args)
    return UpOptions(
        workers=up_workers(args),
        prefill=args.prefill,
        decode=args.decode,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        cluster=args.cluster,
        gateway=up_gateway(args),
        kvstore=args.kvstore,
        decode_lead_cpu=args.decode_lead_cpu,
        tls=args.tls,
        precision=precision,
        kvstore_args=(
            "--ram-mib",
            str(args.kvstore_ram_mib),
            "--disk-mib",
            str(args.kvstore_disk_mib),
        ),
    )
