"""Prometheus metrics of every service, defined once. Each process serves its own /metrics."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

REQUEST_TTFT = Histogram(
    "kvmesh_request_ttft_seconds", "Time to first token", ["service"], buckets=_LATENCY_BUCKETS
)
REQUEST_TPOT = Histogram(
    "kvmesh_request_tpot_seconds",
    "Time per output token after the first",
    ["service"],
    buckets=_LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("kvmesh_prompt_tokens_total", "Prompt tokens received", ["service"])
PROMPT_CACHED_TOKENS = Counter(
    "kvmesh_prompt_cached_tokens_total", "Prompt tokens served from a KV cache", ["service"]
)
PREFIX_LOOKUP_TOKENS = Counter(
    "kvmesh_prefix_lookup_tokens_total", "Prompt tokens a prefill worker looked up in its caches"
)
PREFIX_HIT_TOKENS = Counter(
    "kvmesh_prefix_hit_tokens_total",
    "Prompt tokens served from a cache tier instead of computed (hit ratio per tier = this / "
    "kvmesh_prefix_lookup_tokens_total)",
    ["tier"],  # prefill_local | decode | kvstore
)
GENERATION_TOKENS = Counter("kvmesh_generation_tokens_total", "Tokens generated", ["service"])
REQUESTS = Counter("kvmesh_requests_total", "Requests by outcome", ["service", "outcome"])
KV_TRANSFER_BYTES = Counter(
    "kvmesh_kv_transfer_bytes_total", "KV bytes moved by the transfer engine", ["service"]
)
KV_CAPACITY_TOKENS = Gauge("kvmesh_kv_capacity_tokens", "KV pool capacity in tokens", ["service"])
KV_INTEGRITY_FAILURES = Counter(
    "kvmesh_kv_integrity_failures_total",
    "Requests holding a KV page whose integrity tag did not match (recomputed or aborted, as "
    "--kv-integrity-action says)",
    ["service"],
)
KV_FETCH_DIGEST_MISMATCHES = Counter(
    "kvmesh_kvstore_fetch_digest_mismatches_total",
    "Pages read from the KV store whose bytes did not match their committed digest (misses)",
)
REQUESTS_IN_FLIGHT = Gauge(
    "kvmesh_requests_in_flight",
    "Requests held now: streams at a gateway, requests admitted by a worker (its queue depth)",
    ["service"],
)
REQUEST_MIGRATIONS = Counter(
    "kvmesh_request_migrations_total",
    "Streams moved to another decode worker after theirs died or broke mid-stream",
    ["service", "outcome"],  # outcome: migrated | exhausted (over --migration-limit)
)
FAULTS_INJECTED = Counter(
    "kvmesh_faults_injected_total", "Faults injected for tests (KVMESH_FAULTS)", ["service", "kind"]
)
SPEC_DRAFT_TOKENS = Counter(
    "kvmesh_spec_draft_tokens_total", "Draft tokens proposed and verified", ["service"]
)
SPEC_ACCEPTED_TOKENS = Counter(
    "kvmesh_spec_accepted_tokens_total", "Draft tokens the target model accepted", ["service"]
)
SPEC_ACCEPT_LENGTH = Histogram(
    "kvmesh_spec_acceptance_length",
    "Tokens emitted per verification step (accepted drafts + 1)",
    ["service"],
    buckets=(1, 2, 3, 4, 5, 6, 8, 12, 17),
)
KV_PAGES_USED = Gauge("kvmesh_kv_pages_used", "KV pages held by running requests", ["service"])
GRPC_MESSAGE_BYTES_MAX = Gauge(
    "kvmesh_grpc_message_bytes_max",
    "Largest gRPC message seen (KV bytes never travel over gRPC)",
    ["service"],
)
ROUTING_DECISIONS = Counter(
    "kvmesh_routing_decisions_total", "Router choices by role and reason", ["role", "reason"]
)
KV_STORE_OFFERS_IN_FLIGHT = Gauge(
    "kvmesh_kv_store_offers_in_flight", "Page offers to the KV store not finished yet", ["service"]
)
ROUTER_INDEX_PAGES = Gauge(
    "kvmesh_router_index_pages",
    "Cached pages the gateway's router knows a worker holds",
    ["worker"],
)
ROUTER_WORKER_LOAD = Gauge(
    "kvmesh_router_worker_load_tokens",
    "Token load a worker last reported to the gateway",
    ["worker"],
)


def observe_message(service: str, size: int) -> None:
    """Track the largest gRPC message a service sent or received."""
    gauge = GRPC_MESSAGE_BYTES_MAX.labels(service)
    if size > gauge._value.get():  # noqa: SLF001 - prometheus_client has no max gauge
        gauge.set(size)


# Label values known before the first event (keep in step with the code that writes them).
_OUTCOMES = ("ok", "client_error", "server_error", "cancelled")  # gateway openai_api._outcome
_ROUTING_REASONS = (
    "least_tokens",
    "prefix_hit",
    "affinity",
    "affinity_worker_gone",
    "affinity_yield_load",
)  # kvmesh/routing/router.py policies
_PREFIX_TIERS = ("prefill_local", "decode", "kvstore")
_BY_SERVICE = {
    "gateway": (
        REQUEST_TTFT,
        REQUEST_TPOT,
        PROMPT_TOKENS,
        PROMPT_CACHED_TOKENS,
        GENERATION_TOKENS,
        REQUESTS_IN_FLIGHT,
    ),
    "prefill": (
        KV_TRANSFER_BYTES,
        KV_INTEGRITY_FAILURES,
        GRPC_MESSAGE_BYTES_MAX,
        KV_STORE_OFFERS_IN_FLIGHT,
        REQUESTS_IN_FLIGHT,
    ),
    "decode": (
        GENERATION_TOKENS,
        KV_INTEGRITY_FAILURES,
        KV_PAGES_USED,
        GRPC_MESSAGE_BYTES_MAX,
        SPEC_DRAFT_TOKENS,
        SPEC_ACCEPTED_TOKENS,
        SPEC_ACCEPT_LENGTH,
        KV_STORE_OFFERS_IN_FLIGHT,
        REQUESTS_IN_FLIGHT,
    ),
}


def init_series(service: str, fault_kinds: Iterable[str] = ()) -> None:
    """Create at 0 every labelled series this process may write, for the labels known at start:
    a labelled metric has no series until its first event, so an alert or rate() sees nothing
    (instead of 0) on a healthy process. Call once at process start."""
    for family in _BY_SERVICE.get(service, ()):
        family.labels(service)
    for kind in fault_kinds:
        FAULTS_INJECTED.labels(service, kind)
    if service == "gateway":
        for outcome in _OUTCOMES:
            REQUESTS.labels(service, outcome)
        for outcome in ("migrated", "exhausted"):
            REQUEST_MIGRATIONS.labels(service, outcome)
        for role in ("prefill", "decode"):
            for reason in _ROUTING_REASONS:
                ROUTING_DECISIONS.labels(role, reason)
    if service == "prefill":
        KV_TRANSFER_BYTES.labels("prefill:from_decode")
        for tier in _PREFIX_TIERS:
            PREFIX_HIT_TOKENS.labels(tier)
