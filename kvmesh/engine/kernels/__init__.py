"""The C++ CPU kernels (csrc/, built for AVX-512 or AVX2): paged decode attention, small-batch
linears (bf16 GEMV, AMX tiles), norms, RoPE, argmax.

`cpu_ops()` is the `torch.ops.kvmesh` namespace once the extension is loaded (loading it
registers the ops with torch's dispatcher, so eager code and torch.compile graphs call the same
C++), or None where it cannot run (see build.py); callers keep a torch path for None. A failed
build is logged once with its reason, never raised.
"""

from __future__ import annotations

from typing import Any

import structlog

log = structlog.get_logger(__name__)
_RESOLVED: list[Any] = []  # [ops or None] once resolved: a plain global that dynamo can read
_AMX: list[bool] = []
_ISA: list[str | None] = []


def has_amx() -> bool:
    """True where the kernels run and this CPU lets the process use AMX tiles (Intel Xeon 4th
    generation on; never on AMD): bf16 linears of 5-64 rows then go to the AMX kernel."""
    if not _AMX:
        from kvmesh import env

        ops = cpu_ops()
        _AMX.append(ops is not None and env.amx_kernels() and bool(ops.has_amx()))
    return _AMX[0]


def kernel_isa() -> str | None:
    """The instruction set the loaded kernels were built for ("avx512" or "avx2"; None: no
    kernels). An AVX2 CPU has no bf16 arithmetic: torch's bf16 GEMM runs at a fraction of the
    GEMV tiles' speed at every batch there (docs/benchmarks.md, "CPU kernels vs torch")."""
    if not _ISA:
        from kvmesh.engine.kernels import build

        _ISA.append(build.isa() if cpu_ops() is not None else None)
    return _ISA[0]


def cpu_ops() -> Any | None:
    if not _RESOLVED:
        _RESOLVED.append(_resolve())
        # resolved with the ops, outside any graph: a compiled step then reads plain globals
        # (calling the op while dynamo traces is a graph break: "op returned non-Tensor")
        has_amx()
        kernel_isa()
    return _RESOLVED[0]


def _resolve() -> Any | None:
    from kvmesh.engine.kernels import build

    reason = build.missing_reason()
    if reason is None:
        try:
            build.load()
            import torch

            from kvmesh.engine.kernels import fake  # noqa: F401  (shapes for graph capture)

            return torch.ops.kvmesh
        except Exception as exc:  # a compiler error must not take the engine down
            log.warning("kernels.unavailable", reason=f"build failed: {exc}".splitlines()[0][:300])
            return None
    log.info("kernels.unavailable", reason=reason)  # this CPU or the user's choice: expected
    return None
