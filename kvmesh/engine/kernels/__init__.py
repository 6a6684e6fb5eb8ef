"""The C++ CPU kernels (csrc/): paged decode attention and small-batch bf16 linears.

`cpu_ops()` is the loaded extension, or None where it cannot run (see build.py); callers keep
a torch path for None. A failed build is logged once with its reason, never raised.
"""

from __future__ import annotations

import functools
from types import ModuleType

import structlog

log = structlog.get_logger(__name__)


@functools.cache
def cpu_ops() -> ModuleType | None:
    from kvmesh.engine.kernels import build

    reason = build.missing_reason()
    if reason is None:
        try:
            return build.load()
        except Exception as exc:  # a compiler error must not take the engine down
            reason = f"build failed: {exc}"
    log.warning("kernels.unavailable", reason=reason.splitlines()[0][:300])
    return None
