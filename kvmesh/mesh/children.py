"""The config of every child `kvmesh up` starts, placed (etcd, names, ports) from the run's
options: what each is handed as `--config FILE`, and what `kvmesh config show up` prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvmesh.config import WorkerConfig
from kvmesh.config.draft import DraftConfig, DraftHead
from kvmesh.config.gateway import GatewayConfig
from kvmesh.config.knobs import to_dict
from kvmesh.config.kvstore import KVStoreConfig
from kvmesh.mesh.up_config import UpOptions

UNPLACED = "(set at start)"  # what `config show` prints for what only a run knows


@dataclass(frozen=True)
class RunFacts:
    """What only a run knows: etcd's endpoint, the gateway's ports, the Mooncake master."""

    etcd: str = UNPLACED
    http_port: int = 0
    grpc_port: int = 0
    mooncake_master: str = UNPLACED
    tls: tuple[str, str, str] = ("", "", "")  # `up --tls`: the run's cert, key and CA

    def service(self, options: UpOptions) -> dict[str, str]:
        """The service knobs every child shares: where etcd is, the cluster, TLS."""
        cert, key, ca = self.tls
        return {
            "etcd": self.etcd,
            "cluster": options.cluster,
            "tls_cert": cert,
            "tls_key": key,
            "tls_ca": ca,
        }


def worker(options: UpOptions, at: RunFacts, role: str, name: str) -> WorkerConfig:
    return options.workers[role].placed(**at.service(options), worker_id=name)


def workers(options: UpOptions, at: RunFacts) -> dict[str, WorkerConfig]:
    """Every worker's config, by name (prefill-0, ..., decode-0, ...)."""
    counts = (("prefill", options.prefill), ("decode", options.decode))
    return {
        f"{role}-{i}": worker(options, at, role, f"{role}-{i}")
        for role, count in counts
        for i in range(count)
    }


def gateway(options: UpOptions, at: RunFacts) -> GatewayConfig:
    """The gateway's (its model: the workers')."""
    config = options.gateway
    config = replace(config, api=replace(config.api, model=options.model))
    return config.placed(**at.service(options), http_port=at.http_port, grpc_port=at.grpc_port)


def kvstore(options: UpOptions, at: RunFacts) -> KVStoreConfig:
    """The KV store's: its layout the workers' (adopted from etcd), their transfer protocol;
    with --kvstore mooncake its second tier is Mooncake Store behind the run's master."""
    config = replace(options.store, transfer=options.workers["decode"].transfer)
    if options.kvstore == "mooncake":
        tiers = replace(config.tiers, backend="mooncake", mooncake_master=at.mooncake_master)
        config = replace(config, tiers=tiers)
    return config.placed(**at.service(options))


def draft(options: UpOptions, at: RunFacts) -> DraftConfig:
    """The draft service's (--speculative eagle --draft remote): the decode workers' head."""
    head = DraftHead(options.model, options.workers["decode"].engine.spec.draft_model)
    return DraftConfig(head=head).placed(**at.service(options))


def everything(options: UpOptions, at: RunFacts) -> dict[str, Any]:
    """Every child's config as JSON-able dicts, by child name."""
    out: dict[str, Any] = {name: to_dict(c) for name, c in workers(options, at).items()}
    out["gateway"] = to_dict(gateway(options, at))
    if options.kvstore != "none":
        out["kvstore"] = to_dict(kvstore(options, at))
    if remote_draft(options):
        out["draft"] = to_dict(draft(options, at))
    return out


def remote_draft(options: UpOptions) -> bool:
    decode = options.workers["decode"]
    return decode.engine.spec.speculative == "eagle" and decode.serving.draft == "remote"


def write(run_dir: Path, name: str, config: Any) -> Path:
    """`config` as the file its child is started with."""
    path = run_dir / f"{name}.json"
    path.write_text(json.dumps(to_dict(config)))
    return path
