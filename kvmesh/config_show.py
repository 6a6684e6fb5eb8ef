"""`kvmesh config show COMMAND [FLAGS]`: the config a command would run with, as JSON. For
`kvmesh up`, every child's, as each is handed it (its etcd, ports and Mooncake master filled in
at start); nothing is started."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvmesh.cli_args import build_parser
from kvmesh.config.knobs import to_dict


def effective_config(argv: Sequence[str]) -> dict:
    from kvmesh.config import EngineConfig, WorkerConfig
    from kvmesh.config.flags import from_namespace

    args = build_parser(argv).parse_args(list(argv))
    if args.command == "generate":
        return {"engine": to_dict(from_namespace(EngineConfig, args))}
    if args.command == "serve" and args.service in ("prefill", "decode"):
        return {args.service: to_dict(from_namespace(WorkerConfig, args, role=args.service))}
    if args.command == "serve":
        from kvmesh.config.draft import DraftConfig
        from kvmesh.config.gateway import GatewayConfig
        from kvmesh.config.kvstore import KVStoreConfig

        roots = {"gateway": GatewayConfig, "kvstore": KVStoreConfig, "draft": DraftConfig}
        return {args.service: to_dict(from_namespace(roots[args.service], args))}
    if args.command == "up":
        from kvmesh.mesh import children
        from kvmesh.mesh.up_config import up_options

        return children.everything(up_options(args), children.RunFacts())
    raise SystemExit(f"kvmesh config show: {' '.join(argv[:2])} has no config tree yet")


def run_config_show(argv: Sequence[str]) -> int:
    if not argv:
        raise SystemExit("kvmesh config show: name a command, e.g. `kvmesh config show up`")
    print(json.dumps(effective_config(argv), indent=2))
    return 0
