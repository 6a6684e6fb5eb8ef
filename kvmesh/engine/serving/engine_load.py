"""A worker's load as its router sees it: requests, queued prefill, KV pages in use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.engine.core.engine import Engine


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    prefill_tokens_queued: int
    kv_tokens_active: int
    kv_pages_used: int
    kv_pages_total: int
    kv_capacity_tokens: int
    kv_pages_hashed: int  # what the KV events describe (a router's index should match)


def measure_load(engine: Engine) -> EngineLoad:
    """Under the engine's lock (or before its thread starts)."""
    scheduler, pool = engine.scheduler, engine.block_manager
    queued, active = scheduler.token_loads()
    return EngineLoad(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        prefill_tokens_queued=queued,
        kv_tokens_active=active,
        kv_pages_used=pool.num_used_pages,
        kv_pages_total=pool.config.num_pages,
        kv_capacity_tokens=engine.kv_cache.capacity_tokens,
        kv_pages_hashed=pool.num_hashed_pages,
    )
