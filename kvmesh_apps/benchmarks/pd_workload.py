"""`kvmesh bench pd`'s mixed workload and its arithmetic (the modes and the report: pd.py).

N steady streams each run chat requests back to back (max_tokens fixed, EOS ignored), stream s
starting s * stagger_s late; long prompts (about `long_prompt_tokens` tokens, sized with the
server's tokenizer, a fresh nonce each so no prefix cache serves them, `long_output_tokens`
out) arrive at a fixed rate, the first `first_long_s` after the streams started. The streams
stop starting requests once the last long prompt is done. Only the steady requests that overlap
the window [first long prompt sent, last one done] are measured: the interference is what this
workload is about.

Per steady request TPOT = (last content delta - first) / (tokens - 1); ITL = every gap between
consecutive content deltas of those requests (a stall shows in the ITL tail even when it is
averaged away in a request's TPOT).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh_apps.benchmarks.offline import TOPICS
from kvmesh_apps.benchmarks.serve_client import Streamed, Target, session, stream_request
from kvmesh_apps.benchmarks.serve_suite import long_prompt, notes_for


@dataclass(frozen=True)
class PdWorkload:
    streams: int = 4  # steady decode streams
    stream_tokens: int = 64  # max_tokens of every steady request
    long_prompts: int = 6
    long_prompt_tokens: int = 1500
    long_output_tokens: int = 8
    interval_s: float = 8.0  # one long prompt every interval_s (fixed rate)
    first_long_s: float = 4.0  # the streams run alone this long first
    stagger_s: float = 0.5

    def __post_init__(self) -> None:
        counts = (
            self.streams,
            self.stream_tokens,
            self.long_prompts,
            self.long_prompt_tokens,
            self.long_output_tokens,
        )
        if min(counts) < 1 or self.interval_s <= 0 or min(self.first_long_s, self.stagger_s) < 0:
            raise ValueError(f"PdWorkload needs counts >= 1 and times >= 0: {self}")

    def arrivals(self) -> list[float]:
        """When each long prompt is sent, in seconds after the streams started."""
        return [self.first_long_s + i * self.interval_s for i in range(self.long_prompts)]


@dataclass(frozen=True)
class PdRun:
    """What one mode's workload produced; window = (first long prompt sent, last one done) in
    time.perf_counter() seconds."""

    steady: list[Streamed]
    long: list[Streamed]
    window: tuple[float, float]

    def measured(self) -> list[Streamed]:
        """The steady requests that overlap the window."""
        start, end = self.window
        return [s for s in self.steady if s.sent_at < end and s.sent_at + s.arrivals[-1] > start]


def steady_prompt(stream: int, i: int) -> str:
    return f"Stream {stream}, request {i}: write a long story about {TOPICS[i % len(TOPICS)]}."


async def drive(target: Target, w: PdWorkload) -> PdRun:
    """Run the workload once against `target` (a warmed-up server)."""
    steady: list[Streamed] = []
    long: list[Streamed] = []
    stop = asyncio.Event()
    async with session(1) as client:  # the prompt-length probe's (streams have their own)
        notes = await notes_for(client, target, w.long_prompt_tokens)
        run_id = uuid.uuid4().hex[:8]
        t0 = time.perf_counter()

        async def stream_loop(s: int) -> None:
            await asyncio.sleep(s * w.stagger_s)
            i = 0
            while not stop.is_set():
                steady.append(await stream_request(target, steady_prompt(s, i), w.stream_tokens))
                i += 1

        async def long_one(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            prompt = long_prompt(f"{run_id}-{i}", notes)
            long.append(await stream_request(target, prompt, w.long_output_tokens))

        loops = [asyncio.create_task(stream_loop(s)) for s in range(w.streams)]
        await asyncio.gather(*(long_one(i, at) for i, at in enumerate(w.arrivals())))
        end = time.perf_counter()
        stop.set()
        await asyncio.gather(*loops)
    return PdRun(steady, long, (t0 + w.first_long_s, end))


# ---- report arithmetic ------------------------------------------------------------------------


def pct_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def summarize_run(run: PdRun) -> dict[str, Any]:
    """Percentiles (ms) of the measured steady requests and of the long prompts."""
    steady = run.measured()
    tpots = [t.tpot_s for t in (s.timing() for s in steady) if t.tpot_s is not None]
    gaps = [g for s in steady for g in s.gaps]
    long_ttft = [s.arrivals[0] for s in run.long]
    exact = all(s.timing().exact for s in [*steady, *run.long])
    return {
        "steady_requests": len(steady),
        "steady_tpot_p50_ms": pct_ms(tpots, 50),
        "steady_tpot_p90_ms": pct_ms(tpots, 90),
        "steady_itl_p50_ms": pct_ms(gaps, 50),
        "steady_itl_p90_ms": pct_ms(gaps, 90),
        "steady_itl_p99_ms": pct_ms(gaps, 99),
        "steady_ttft_p50_ms": pct_ms([s.arrivals[0] for s in steady], 50),
        "steady_ttft_p90_ms": pct_ms([s.arrivals[0] for s in steady], 90),
        "long_requests": len(run.long),
        "long_prompt_tokens": sorted(s.prompt_tokens for s in run.long if s.prompt_tokens),
        "long_ttft_p50_ms": pct_ms(long_ttft, 50),
        "long_ttft_p90_ms": pct_ms(long_ttft, 90),
        "steady_tok_s": _rate(steady, run.window),
        "window_s": round(run.window[1] - run.window[0], 2),
        "lengths_exact": exact,
    }


def _rate(steady: list[Streamed], window: tuple[float, float]) -> float | None:
    """Steady tokens delivered inside the window per second of it."""
    start, end = window
    inside = sum(start <= s.sent_at + a <= end for s in steady for a in s.arrivals)
    return round(inside / (end - start), 1) if end > start else None


def ratios(colocated: dict[str, Any], disaggregated: dict[str, Any]) -> dict[str, float | None]:
    """disaggregated / colocated for every percentile (below 1: disaggregation is faster)."""
    keys = [k for k in colocated if k.endswith("_ms")]
    return {
        k.removesuffix("_ms"): round(disaggregated[k] / colocated[k], 3)
        if colocated.get(k) and disaggregated.get(k) is not None
        else None
        for k in keys
    }
