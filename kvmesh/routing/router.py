"""Routing v1: token-aware least load over the live prefill and decode workers.

A policy sees the candidates with their estimated token loads and returns a decision with a
reason; session affinity and prefix-aware policies plug in as further `RoutingPolicy` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
import structlog

from kvmesh.mesh import metrics
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.error_mapping import WorkerUnavailableError as WorkerUnavailable
from kvmesh.mesh.grpc_server import channel
from kvmesh.proto.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from kvmesh.routing import ROUTINGS

if TYPE_CHECKING:
    from kvmesh.routing.prefix import PrefixLookup, PromptKey

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Candidate:
    info: WorkerInfo
    load_tokens: int  # max(this gateway's in-flight estimate, what the worker last reported)
    cached_tokens: int = 0  # leading prompt tokens whose KV the worker already holds


@dataclass(frozen=True)
class Decision:
    worker: WorkerInfo
    reason: str


class RoutingPolicy(Protocol):
    def choose(
        self, role: str, candidates: list[Candidate], cost_tokens: int, preferred: str | None
    ) -> Decision | None: ...


class LeastTokensPolicy:
    """Cloudflare-style token-aware balancing: the worker with the fewest tokens in flight."""

    def choose(
        self, role: str, candidates: list[Candidate], cost_tokens: int, preferred: str | None = None
    ) -> Decision | None:
        if not candidates:
            return None
        best = min(candidates, key=lambda c: (c.load_tokens, c.info.worker_id))
        return Decision(best.info, "least_tokens")


class PrefixAwarePolicy:
    """Cost = tokens in flight + the prompt tokens the worker lacks; least cost wins."""

    def choose(
        self, role: str, candidates: list[Candidate], cost_tokens: int, preferred: str | None = None
    ) -> Decision | None:
        if not candidates:
            return None
        best = min(
            candidates,
            key=lambda c: (c.load_tokens + cost_tokens - c.cached_tokens, c.info.worker_id),
        )
        return Decision(best.info, "prefix_hit" if best.cached_tokens else "least_tokens")


@dataclass(frozen=True)
class AffinityPolicy:
    """Keep a session on its pinned worker unless that worker is far above the least loaded one:
    pinned load > max_load_ratio * least load + slack_tokens (both configurable)."""

    max_load_ratio: float = 2.0
    slack_tokens: int = 2048
    fallback: RoutingPolicy = PrefixAwarePolicy()

    def choose(
        self, role: str, candidates: list[Candidate], cost_tokens: int, preferred: str | None
    ) -> Decision | None:
        least = self.fallback.choose(role, candidates, cost_tokens, None)
        if least is None or preferred is None:
            return least
        pinned = next((c for c in candidates if c.info.worker_id == preferred), None)
        if pinned is None:
            return Decision(least.worker, "affinity_worker_gone")
        least_load = min(c.load_tokens for c in candidates)
        if pinned.load_tokens > self.max_load_ratio * least_load + self.slack_tokens:
            return Decision(least.worker, "affinity_yield_load")
        return Decision(pinned.info, "affinity")


LOGGED_CANDIDATES = 16


class RoundRobinPolicy:
    """Each worker of a role in turn, blind to load and cache (a baseline)."""

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def choose(
        self, role: str, candidates: list[Candidate], cost_tokens: int, preferred: str | None = None
    ) -> Decision | None:
        if not candidates:
            return None
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        ordered = sorted(candidates, key=lambda c: c.info.worker_id)
        return Decision(ordered[turn % len(ordered)].info, "round_robin")


def make_router(
    live: Callable[[str], list[WorkerInfo]],
    routing: str,
    prefix: PrefixLookup,
    affinity: AffinityPolicy | None = None,
) -> Router:
    """The gateway's router for `--routing` (one of ROUTINGS): cache-aware = session affinity
    over prefix scores (`affinity`), prefix-aware = prefix scores alone, least-load and
    round-robin ignore prefixes. `kvmesh sim` builds its routers here too."""
    if routing == "cache-aware":
        return Router(live, affinity or AffinityPolicy(), prefix)
    if routing == "prefix-aware":
        return Router(live, PrefixAwarePolicy(), prefix)
    if routing == "least-load":
        return Router(live, LeastTokensPolicy())
    if routing == "round-robin":
        return Router(live, RoundRobinPolicy())
    raise ValueError(f"unknown routing {routing!r}: one of {', '.join(ROUTINGS)}")


class Router:
    def __init__(
        self,
        live: Callable[[str], list[WorkerInfo]],
        policy: RoutingPolicy | None = None,
        prefix: PrefixLookup | None = None,
    ) -> None:
        self._live = live
        self.prefix = prefix
        self.policy = policy or AffinityPolicy()
        self._inflight: dict[str, int] = {}
        self._reported: dict[str, int] = {}

    def pick(
        self,
        role: str,
        cost_tokens: int,
        exclude: Iterable[str] = (),
        preferred: str | None = None,
        prompt: PromptKey | None = None,
        paired_with: WorkerInfo | None = None,
    ) -> Decision:
        """The worker for `role`; with `paired_with`, only workers whose KV pages have its
        layout (model, page size, KV dtype) are candidates."""
        excluded = set(exclude)
        candidates = [
            Candidate(w, self._load(w.worker_id), self._cached(w, prompt))
            for w in self._live(role)
            if w.worker_id not in excluded
            and (paired_with is None or w.kv_layout == paired_with.kv_layout)
        ]
        decision = self.policy.choose(role, candidates, cost_tokens, preferred)
        if decision is None:
            raise WorkerUnavailable(f"no live {role} worker")
        metrics.ROUTING_DECISIONS.labels(role, decision.reason).inc()
        log.info(
            "router.decision",
            role=role,
            worker=decision.worker.worker_id,
            reason=decision.reason,
            candidates=len(candidates),
            # every candidate's (load, cached) on a small mesh; on a large one a line per
            # request would grow with the fleet (kvmesh sim: 500 workers)
            load=[(c.info.worker_id, c.load_tokens, c.cached_tokens) for c in candidates]
            if len(candidates) <= LOGGED_CANDIDATES
            else None,
        )
        return decision

    def _load(self, worker_id: str) -> int:
        return max(self._inflight.get(worker_id, 0), self._reported.get(worker_id, 0))

    def _cached(self, worker: WorkerInfo, prompt: PromptKey | None) -> int:
        if prompt is None or self.prefix is None:
            return 0
        return self.prefix.cached_tokens(worker, prompt)

    def prefilled(
        self, prompt: PromptKey, decode: WorkerInfo, prefill: WorkerInfo | None, cached: int = 0
    ) -> None:
        """A request's first token came: the prompt's full pages are cached on both workers (in
        the prefix index at once, ahead of their KV events), and the prefill worker is done with
        the prompt (its last polled load may still count the `cached`-less part it computed).
        So a request with the same prefix right after goes there."""
        if prefill is not None and prefill.worker_id in self._reported:
            left = self._reported[prefill.worker_id] - max(0, len(prompt.token_ids) - cached)
            self._reported[prefill.worker_id] = max(0, left)
        if self.prefix is not None:
            for worker in (decode, prefill):
                if worker is not None:
                    self.prefix.add(worker, prompt)

    @contextlib.contextmanager
    def holding(self, worker_id: str, tokens: int):
        """Count `tokens` against a worker while a request runs there."""
        self._inflight[worker_id] = self._inflight.get(worker_id, 0) + tokens
        try:
            yield
        finally:
            self._inflight[worker_id] -= tokens

    def report(self, worker_id: str, tokens: int) -> None:
        """What a worker says it has in flight (its polled load)."""
        self._reported[worker_id] = tokens
        metrics.ROUTER_WORKER_LOAD.labels(worker_id).set(tokens)

    async def poll_loads(self, period: float = 1.0) -> None:
        """Refresh what workers report (requests from other gateways count too)."""
        channels: dict[str, grpc.aio.Channel] = {}
        while True:
            for role in ("prefill", "decode"):
                for worker in self._live(role):
                    if worker.grpc_address not in channels:
                        channels[worker.grpc_address] = channel(worker.grpc_address)
                    ch = channels[worker.grpc_address]
                    self.report(worker.worker_id, await _reported_tokens(ch, role))
            await asyncio.sleep(period)


async def _reported_tokens(ch: grpc.aio.Channel, role: str) -> int:
    stub_cls = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
    try:
        response = await stub_cls(ch).GetLoads(decode_pb2.GetLoadsRequest(), timeout=1.0)
    except grpc.aio.AioRpcError:
        return 0
    load = response.loads[0] if response.loads else None
    if load is None:
        return 0
    return reported_load(role, load.prefill_tokens_queued, load.kv_tokens_active)


def reported_load(role: str, prefill_tokens_queued: int, kv_tokens_active: int) -> int:
    """The figure of a worker's load the router balances on: prompt tokens queued on a prefill
    worker, tokens of running sequences on a decode worker."""
    return prefill_tokens_queued if role == "prefill" else kv_tokens_active
