"""CPU time each process of the mesh spends while a benchmark level runs (Linux /proc).

On a machine whose cores the decode worker's threads already fill, every CPU-millisecond the
gateway, the other workers or the client spend per token is taken from decode's steps: this
shows where the mesh's time per token goes beyond the engine's (`kvmesh bench serve`)."""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from pathlib import Path

CLIENT = "bench client"  # this process: the HTTP client (and an idle in-process engine)
_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of `pid` and every live descendant (0 when it is gone)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return total


class CpuMeter:
    """Samples of CPU seconds per named process (and this one, as CLIENT)."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)

    def sample(self) -> dict[str, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        return {
            **{name: tree_cpu_s(pid) for name, pid in self.pids.items()},
            CLIENT: own.ru_utime + own.ru_stime,
        }

    @staticmethod
    def per_token(
        before: Mapping[str, float], after: Mapping[str, float], tokens: int
    ) -> dict[str, float]:
        """CPU milliseconds per output token of each process between two samples."""
        if tokens <= 0:
            return {}
        return {
            name: round((after[name] - before[name]) * 1e3 / tokens, 3)
            for name in after
            if name in before
        }
