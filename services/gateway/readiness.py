"""Gateway readiness: ready when a chat request would succeed.

That needs a live decode worker and a way to prefill for it: a live prefill worker whose KV page
layout (model, page size, KV dtype) the decode worker takes, or the decode worker itself, which
prefills a prompt when the gateway hands it no prefill worker (MeshBackend._pick_prefill). So
with any live decode worker there is a way to prefill; prefill workers only make it faster.

GET /health answers readiness (503 with an OpenAI error body until ready); grpc.health.v1
follows it (`follow`); GET /live is liveness only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.grpc_server import HealthStatus

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ReadyState:
    ready: bool
    reason: str  # why not ready; when ready, how prompts get prefilled


class Readiness(Protocol):
    def check(self) -> ReadyState: ...


class AlwaysReady:
    """A backend with nothing to wait for (an in-process engine, a test double)."""

    def check(self) -> ReadyState:
        return ReadyState(True, "ready")


class MeshReadiness:
    """Readiness from the workers the gateway sees alive (its etcd watch)."""

    def __init__(self, live: Callable[[str], list[WorkerInfo]]) -> None:
        self._live = live

    def check(self) -> ReadyState:
        decode, prefill = self._live("decode"), self._live("prefill")
        if not decode:
            return ReadyState(
                False,
                f"no live decode worker yet ({len(prefill)} prefill worker(s) registered): "
                "the mesh is starting, or its decode workers are gone",
            )
        layouts = {worker.kv_layout for worker in decode}
        paired = sum(worker.kv_layout in layouts for worker in prefill)
        how = f"{paired} prefill worker(s)" if paired else "the decode workers themselves"
        return ReadyState(True, f"{len(decode)} decode worker(s); prompts prefilled by {how}")


async def follow(readiness: Readiness, health: HealthStatus, period_s: float = 0.5) -> None:
    """Keep the gRPC health status equal to readiness: SERVING only while ready."""
    while True:
        state = readiness.check()
        if state.ready != health.serving:
            log.info("gateway.readiness", ready=state.ready, reason=state.reason)
            await health.set_serving(state.ready)
        await asyncio.sleep(period_s)
