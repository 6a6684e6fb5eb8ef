"""What a run comes to: hit ratio, TTFT and TPOT percentiles, per-worker load."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvmesh_apps.sim.fleet import Run
from kvmesh_apps.sim.gateway import Record


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass(frozen=True)
class Summary:
    label: str
    requests: int
    errors: int
    hit_ratio: float  # cached prompt tokens / prompt tokens
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    output_tokens_s: float
    decode_busy: tuple[float, ...]  # per decode worker: fraction of the run spent in steps
    prefill_busy: tuple[float, ...]
    decode_requests: tuple[int, ...]  # requests each decode worker served
    preemptions: int
    sim_s: float

    @property
    def load_spread(self) -> float:
        """Coefficient of variation of the decode workers' busy fractions (0: even)."""
        busy = self.decode_busy
        mean = _mean(busy)
        return statistics.pstdev(busy) / mean if len(busy) > 1 and mean else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "load_spread": self.load_spread}


def summarize(run: Run) -> Summary:
    done = [r for r in run.records if not r.error]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    length = run.sim_s or 1.0
    served = Counter(r.decode for r in done)
    decode = [w for w in run.workers if w.info.role == "decode"]
    prefill = [w for w in run.workers if w.info.role == "prefill"]
    return Summary(
        run.fleet.label,
        len(run.records),
        len(run.records) - len(done),
        sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        percentile(ttft, 50),
        percentile(ttft, 90),
        percentile(tpot, 50),
        percentile(tpot, 90),
        sum(len(r.token_times) for r in done) / length,
        tuple(round(w.busy_s / length, 4) for w in decode),
        tuple(round(w.busy_s / length, 4) for w in prefill),
        tuple(served.get(w.worker_id, 0) for w in decode),
        sum(w.preemptions for w in run.workers),
        run.sim_s,
    )


def table(summaries: list[Summary]) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1000:,.1f}"  # noqa: E731
    head = (
        "| fleet, routing | requests | hit ratio | TTFT p50 / p90 ms | TPOT p50 / p90 ms | "
        "out tok/s | decode busy min-max | spread |"
    )
    rows = [head, "|" + "---|" * 8]
    for s in summaries:
        busy = f"{min(s.decode_busy):.2f}-{max(s.decode_busy):.2f}" if s.decode_busy else "-"
        rows.append(
            f"| {s.label} | {s.requests}{f' ({s.errors} failed)' if s.errors else ''} | "
            f"{s.hit_ratio:.1%} | {ms(s.ttft_p50_s)} / {ms(s.ttft_p90_s)} | "
            f"{ms(s.tpot_p50_s)} / {ms(s.tpot_p90_s)} | {s.output_tokens_s:,.0f} | {busy} | "
            f"{s.load_spread:.2f} |"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class Figures:
    """Compared by mean: a small run's TTFT is bimodal (a prompt queued behind another or
    not), and its p50 jumps between the modes from run to run; the mean moves less."""

    hit_ratio: float
    ttft_mean_s: float
    tpot_mean_s: float
    ttft_p50_s: float
    tpot_p50_s: float
    requests: int
    errors: int

    @classmethod
    def of(cls, records: list[Record]) -> Figures:
        done = [r for r in records if not r.error]
        prompt = sum(r.prompt_tokens for r in done) or 1
        ttft = [r.ttft_s for r in done if r.ttft_s is not None]
        tpot = [r.tpot_s for r in done if r.tpot_s is not None]
        return cls(
            sum(r.cached_tokens for r in done) / prompt,
            _mean(ttft),
            _mean(tpot),
            percentile(ttft, 50) or 0.0,
            percentile(tpot, 50) or 0.0,
            len(records),
            len(records) - len(done),
        )
