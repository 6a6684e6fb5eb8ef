"""What the engine's host (a worker, a benchmark) hears from it, given at construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineListeners:
    # a request whose page failed its integrity tag (its KV recomputed, or it aborted)
    integrity_failure: Callable[[str], None] | None = None
    # a fault injected by KVMESH_FAULTS (tests): its kind
    fault_injected: Callable[[str], None] | None = None
    # a speculative verification: (tokens drafted, tokens emitted)
    speculation: Callable[[int, int], None] | None = None
