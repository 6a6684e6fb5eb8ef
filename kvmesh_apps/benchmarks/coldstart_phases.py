"""Start-up phases of one `kvmesh up`, read back from its services' structured logs.

Every mark is seconds since the bench launched `kvmesh up`. Per process (one `<name>.log` in
the run folder): exec (from /proc, logged with `process.imports_done`), imports done, weights
loaded, tokenizer loaded, model built (fused / cast tensors), engine ready (KV pool, scheduler),
ready (registered in etcd; the gateway: serving). Logs of a tree without some of these lines
(an older commit) leave those marks None.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

# event -> the mark it sets (the first occurrence counts)
_MARKS = {
    "process.imports_done": "imports_done",
    "engine.weights_loaded": "weights_loaded",
    "tokenizer.loaded": "tokenizer_loaded",
    "engine.model_built": "model_built",
    "engine.ready": "engine_ready",
    "worker.ready": "ready",
    "gateway.ready": "ready",
    "gateway.listening": "ready",  # the newer name: HTTP and gRPC served
    "kvstore.ready": "ready",
}
MARKS = (
    "exec",
    "imports_done",
    "weights_loaded",
    "tokenizer_loaded",
    "model_built",
    "engine_ready",
    "ready",
)


@dataclass(frozen=True)
class ProcessPhases:
    """One service process's marks (s since launch) and what its logs said about the load."""

    name: str
    marks: dict[str, float | None]
    weights_cache: str | None  # hit | miss | off (None: not logged)
    tokenizer_cache: str | None


def timestamp(line: dict[str, Any]) -> float | None:
    """A structlog ISO timestamp as a Unix time."""
    text = line.get("timestamp")
    return datetime.fromisoformat(text).timestamp() if isinstance(text, str) else None


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return out


def process_phases(log: Path, launched: float) -> ProcessPhases:
    marks: dict[str, float | None] = dict.fromkeys(MARKS)
    caches: dict[str, str | None] = {"engine.weights_loaded": None, "tokenizer.loaded": None}
    for line in json_lines(log.read_text(errors="replace")):
        event, at = line.get("event"), timestamp(line)
        mark = _MARKS.get(event)
        if mark is None or at is None or marks[mark] is not None:
            continue
        marks[mark] = round(at - launched, 3)
        if event == "process.imports_done" and line.get("exec_at"):
            marks["exec"] = round(line["exec_at"] - launched, 3)
        if event in caches:
            caches[event] = line.get("cache")
    return ProcessPhases(
        log.stem, marks, caches["engine.weights_loaded"], caches["tokenizer.loaded"]
    )


def run_phases(run_dir: Path, launched: float) -> list[ProcessPhases]:
    return [process_phases(log, launched) for log in sorted(run_dir.glob("*.log"))]


def _latest(processes: list[ProcessPhases], mark: str, workers_only: bool = True) -> float | None:
    values = [
        p.marks[mark]
        for p in processes
        if not workers_only or p.name.startswith(("prefill", "decode"))
    ]
    known = [v for v in values if v is not None]
    return max(known) if known and len(known) == len(values) else None


def summary(processes: list[ProcessPhases], up: dict[str, float | None]) -> dict[str, Any]:
    """The critical path: `kvmesh up`'s own marks, then each phase's latest worker."""
    gateway = next((p for p in processes if p.name == "gateway"), None)
    out: dict[str, Any] = dict(up)
    out["first_spawn_s"] = min(
        (p.marks["exec"] for p in processes if p.marks["exec"] is not None), default=None
    )
    for mark in MARKS:
        out[f"workers_{mark}_s"] = _latest(processes, mark)
    out["first_pair_ready_s"] = _first_pair(processes)
    out["gateway_ready_s"] = gateway.marks["ready"] if gateway else None
    return out


def _first_pair(processes: list[ProcessPhases]) -> float | None:
    """When one prefill and one decode worker had both registered (enough to serve)."""
    firsts = []
    for role in ("prefill", "decode"):
        ready = [p.marks["ready"] for p in processes if p.name.startswith(role)]
        firsts.append(min((r for r in ready if r is not None), default=None))
    return None if None in firsts else max(firsts)  # type: ignore[type-var]


def process_rows(processes: list[ProcessPhases]) -> list[dict[str, Any]]:
    return [asdict(p) for p in processes]


SUMMARY_COLUMNS = (
    ("cli_s", "`up` parsed"),
    ("etcd_s", "etcd up"),
    ("first_spawn_s", "1st spawn"),
    ("workers_exec_s", "workers exec"),
    ("workers_imports_done_s", "imports done"),
    ("workers_weights_loaded_s", "weights loaded"),
    ("workers_tokenizer_loaded_s", "tokenizer"),
    ("workers_model_built_s", "model built"),
    ("workers_engine_ready_s", "engine ready"),
    ("first_pair_ready_s", "1st pair registered"),
    ("workers_ready_s", "all registered"),
    ("gateway_ready_s", "gateway ready"),
    ("first_token_s", "**first token**"),
)


def markdown(runs: list[dict[str, Any]]) -> str:
    """One row per run: s since launch at which the slowest worker reached each phase (load:
    the 1-minute load average when the run started)."""
    head = ["mesh", "variant", "load", "`--help` s", *(title for _, title in SUMMARY_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for run in runs:
        cells = [
            run["mesh"],
            run["variant"],
            _fmt(run.get("loadavg_1m"), 1),
            _fmt(run.get("help_s")),
        ]
        cells += [_fmt(run["summary"].get(key)) for key, _ in SUMMARY_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"
