"""What every benchmark report records about its run: when, where, how it was invoked, how long
it took and how busy the box was -- and writing the JSON next to the markdown."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path


@dataclass
class BenchRun:
    """Started when created; `header` and `footer` frame the report's own fields."""

    started: float = field(default_factory=time.perf_counter)
    load_before: float = field(default_factory=lambda: os.getloadavg()[0])

    @staticmethod
    def header() -> dict:
        import torch

        env = [f"{k}={os.environ[k]}" for k in ("KVMESH_NUM_THREADS",) if os.environ.get(k)]
        return {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "command": shlex.join(env + _invocation() + sys.argv[1:]),
        }

    def footer(self) -> dict:
        return {
            "wall_s": round(time.perf_counter() - self.started, 1),
            "loadavg_1m_before_after": [self.load_before, os.getloadavg()[0]],  # other work
        }


def write_report(report: dict, output: str | None) -> None:
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=2) + "\n")


def _invocation() -> list[str]:
    """`python -m module`, or the script's name (e.g. `kvmesh`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # None: run as a script
    if spec is not None:
        return ["python", "-m", spec.name.removesuffix(".__main__")]
    return [Path(sys.argv[0]).name]
