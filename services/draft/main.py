"""`kvmesh serve draft`: the EAGLE draft service process (gRPC, metrics, etcd registration)."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass

import structlog

from kvmesh.engine.serving.engine_thread import build_engine
from kvmesh.mesh import addresses, etcd_access, tls
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.service_runtime import Listen, Served, serve_registered
from services.draft.server import DraftServicer, add_to

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DraftOptions:
    etcd: str
    cluster: str = "default"
    model: str = "smollm2-135m"
    draft_model: str = ""  # EAGLE head file; empty: the one shipped for the model
    host: str = "127.0.0.1"  # where it listens (0.0.0.0: every interface)
    advertise_host: str = ""  # what peers dial (its etcd registration); "": host
    port: int = 0
    metrics_port: int = 0
    ttl: int = 5

    def __post_init__(self) -> None:
        addresses.advertised(self.host, self.advertise_host)  # a wildcard needs advertise_host


def build_proposer(model: str, draft_model: str):
    """The head plus the target's token embeddings (the only target weights it needs)."""
    from kvmesh.engine.loader import load_weights, resolve_model
    from kvmesh.engine.spec.eagle import load_head
    from kvmesh.engine.spec.eagle_proposer import EagleProposer

    source = resolve_model(model)
    head = load_head(draft_model or None, source.name)
    _, weights = load_weights(source)
    return EagleProposer(head, weights["model.embed_tokens.weight"].float()), source.name


async def serve_draft(options: DraftOptions) -> None:
    worker_id = f"draft-{uuid.uuid4().hex[:8]}"
    structlog.contextvars.bind_contextvars(service="draft", worker_id=worker_id)
    proposer, model_name = build_engine(  # on a thread that exits: engine_thread.py
        lambda: build_proposer(options.model, options.draft_model)
    )
    public = addresses.advertised(options.host, options.advertise_host)
    listen = Listen("draft", worker_id, options.host, public, options.port,
                    options.metrics_port, options.etcd, options.cluster, options.ttl)  # fmt: skip

    def describe(served: Served) -> WorkerInfo:
        return WorkerInfo(role="draft", worker_id=worker_id, grpc_address=served.grpc,
                          metrics_address=served.metrics, model=model_name,
                          extra={"window": proposer.head.config.window})  # fmt: skip

    await serve_registered(listen, [add_to(DraftServicer(proposer))], describe)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default="", help="etcd endpoint host:port (empty: not registered)")
    tls.add_arguments(p)
    etcd_access.add_arguments(p)
    p.add_argument("--cluster", default="default")
    addresses.add_arguments(p)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft-model", default="", help="EAGLE head (default: the shipped one)")


def options_from(args: argparse.Namespace) -> DraftOptions:
    return DraftOptions(
        etcd=args.etcd,
        cluster=args.cluster,
        model=args.model,
        draft_model=args.draft_model,
        host=args.host,
        advertise_host=args.advertise_host,
        port=args.port,
        metrics_port=args.metrics_port,
    )
