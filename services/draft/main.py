"""`kvmesh serve draft`: the EAGLE draft service process (gRPC, metrics, etcd registration)."""

from __future__ import annotations

import uuid

import structlog

from kvmesh.config.draft import DraftConfig
from kvmesh.engine.serving.engine_thread import build_engine
from kvmesh.mesh import addresses
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.service_runtime import Listen, Served, serve_registered
from services.draft.server import DraftServicer, add_to

log = structlog.get_logger(__name__)


def build_proposer(model: str, draft_model: str):
    """The head plus the target's token embeddings (the only target weights it needs)."""
    from kvmesh.engine.loader import load_weights, resolve_model
    from kvmesh.engine.spec.eagle import load_head
    from kvmesh.engine.spec.eagle_proposer import EagleProposer

    source = resolve_model(model)
    head = load_head(draft_model or None, source.name)
    _, weights = load_weights(source)
    return EagleProposer(head, weights["model.embed_tokens.weight"].float()), source.name


def check_addresses(config: DraftConfig) -> str:
    """The address peers dial (a wildcard --host needs --advertise-host)."""
    return addresses.advertised(config.service.host, config.service.advertise_host)


async def serve_draft(config: DraftConfig) -> None:
    service = config.service
    worker_id = service.worker_id or f"draft-{uuid.uuid4().hex[:8]}"
    structlog.contextvars.bind_contextvars(service="draft", worker_id=worker_id)
    proposer, model_name = build_engine(  # on a thread that exits: engine_thread.py
        lambda: build_proposer(config.head.model, config.head.draft_model)
    )
    listen = Listen(
        "draft",
        worker_id,
        service.host,
        check_addresses(config),
        service.port,
        service.metrics_port,
        service.etcd,
        service.cluster,
        service.lease_ttl,
    )

    def describe(served: Served) -> WorkerInfo:
        return WorkerInfo(
            role="draft",
            worker_id=worker_id,
            grpc_address=served.grpc,
            metrics_address=served.metrics,
            model=model_name,
            extra={"window": proposer.head.config.window},
        )

    await serve_registered(listen, [add_to(DraftServicer(proposer))], describe)
