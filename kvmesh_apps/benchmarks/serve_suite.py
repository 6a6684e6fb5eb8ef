"""What `kvmesh bench serve` measures on a server: single-stream decode, TTFT on a long prompt,
and aggregate throughput at several concurrency levels (kvmesh_apps.benchmarks.serve_client sends).

- Single stream: requests one after the other; decode tok/s = 1 / TPOT, TPOT = (last content
  delta - first) / (tokens - 1).
- Long prompt: distinct prompts of about `tokens` tokens (sized with the server's own tokenizer:
  two one-token requests measure it), each starting with a fresh nonce so no prefix cache
  serves it, one at a time; TTFT = first content delta - send.
- Level C: C client loops take the next prompt until N are done; tok/s = all output tokens /
  wall time of the level.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import aiohttp
import numpy as np

from kvmesh import event_loop
from kvmesh_apps.benchmarks.offline import TOPICS
from kvmesh_apps.benchmarks.serve_client import (
    Messages,
    Prompt,
    RequestTiming,
    Target,
    prompt_tokens,
    session,
    stream_request,
)

CHARS_PER_TOKEN = 4.0  # the guess when a server reports no usage


def level_prompts(concurrency: int, n: int) -> list[Messages]:
    """Distinct per level, so one level never reuses another's prompt (prefix cache)."""
    return [
        [
            {
                "role": "user",
                "content": f"Level {concurrency}, request {i}: write a short story about "
                f"{TOPICS[i % len(TOPICS)]}.",
            }
        ]
        for i in range(n)
    ]


def requests_for(concurrency: int, requests_per_level: int | None) -> int:
    return requests_per_level or max(2 * concurrency, 4)


def long_prompt(nonce: str, notes: int) -> str:
    """A deterministic prompt of `notes` numbered lines after a nonce (prefix-cache proof)."""
    lines = [f"Run {nonce}. Read these notes, then summarise them in one sentence."]
    for i in range(notes):
        lines.append(
            f"Note {i + 1}: the story about {TOPICS[i % len(TOPICS)]} has {i % 7 + 2} "
            f"characters and ends in chapter {i % 11 + 3}."
        )
    return "\n".join(lines)


# ---- the phases -------------------------------------------------------------------------------


async def client_loops(
    target: Target, prompts: list[Prompt], concurrency: int, max_tokens: int
) -> tuple[list[RequestTiming], float]:
    """C loops, each taking the next prompt until none is left; returns timings and wall time."""
    todo = deque(enumerate(prompts))
    timings: list[RequestTiming | None] = [None] * len(prompts)

    async def loop() -> None:
        while todo:
            i, prompt = todo.popleft()
            timings[i] = (await stream_request(target, prompt, max_tokens)).timing()

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return [t for t in timings if t is not None], wall


def measure_level(
    target: Target, concurrency: int, n_requests: int, max_tokens: int, path: str = "server"
) -> dict[str, Any]:
    """One concurrency level against a running server."""
    prompts: list[Prompt] = list(level_prompts(concurrency, n_requests))
    timings, wall = event_loop.run(client_loops(target, prompts, concurrency, max_tokens))
    return summarize(path, concurrency, timings, wall)


def measure_single_stream(
    target: Target, n_requests: int, max_tokens: int, probe: Callable[[], float] | None = None
) -> dict[str, Any]:
    """Requests one at a time; with `probe` (the memory-read ceiling, GB/s), also measured before
    the first and after each request (`ceilings_gbs`, one more than `request_tok_s`): this VM's
    ceiling moves by a third within a minute, so each request is put against the two beside it."""
    prompts: list[Prompt] = [
        f"Single stream, request {i}: write a long story about {TOPICS[i % len(TOPICS)]}."
        for i in range(n_requests)
    ]
    ceilings = [probe()] if probe else []
    timings, wall, rates = [], 0.0, []  # rates: one per request (0: it failed), as ceilings
    for prompt in prompts:
        got, seconds = event_loop.run(client_loops(target, [prompt], 1, max_tokens))
        timings, wall = timings + got, wall + seconds
        rates.append(1.0 / got[0].tpot_s if got and got[0].tpot_s else 0.0)
        if probe:
            ceilings.append(probe())
    row = summarize("single_stream", 1, timings, wall)
    measured = [r for r in rates if r]
    extra = {"ceilings_gbs": [round(c, 2) for c in ceilings]} if probe else {}
    return {
        "decode_tok_s": round(float(np.median(measured)), 2) if measured else None,
        "request_tok_s": [round(r, 2) for r in rates],
        **extra,
        **row,
    }


def measure_long_prompt(
    target: Target, n_requests: int, tokens: int, max_tokens: int
) -> dict[str, Any]:
    async def run() -> tuple[list[RequestTiming], float]:
        async with session(1) as client:
            notes = await notes_for(client, target, tokens)
        run_id = uuid.uuid4().hex[:8]
        prompts: list[Prompt] = [long_prompt(f"{run_id}-{i}", notes) for i in range(n_requests)]
        return await client_loops(target, prompts, 1, max_tokens)

    timings, wall = event_loop.run(run())
    row = summarize("long_prompt", 1, timings, wall)
    sizes = [t.prompt_tokens for t in timings if t.prompt_tokens is not None]
    return {"target_prompt_tokens": tokens, "prompt_tokens": sizes or None, **row}


async def notes_for(client: aiohttp.ClientSession, target: Target, tokens: int) -> int:
    """How many notes make a prompt of about `tokens` tokens on this server."""
    probe = uuid.uuid4().hex[:8]
    base = await prompt_tokens(client, target, long_prompt(probe, 0))
    ten = await prompt_tokens(client, target, long_prompt(probe, 10))
    if base is None or ten is None or ten <= base:
        per_note = len(long_prompt(probe, 10)) / 10 / CHARS_PER_TOKEN
        return max(1, round(tokens / per_note))
    return max(1, round((tokens - base) / ((ten - base) / 10)))


# ---- summaries --------------------------------------------------------------------------------


def ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def summarize(
    path: str, concurrency: int, timings: list[RequestTiming], wall_s: float
) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in timings]
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
    tokens = sum(t.tokens for t in timings)
    return {
        "path": path,
        "concurrency": concurrency,
        "num_requests": len(timings),
        "ttft_p50_ms": ms(ttfts, 50),
        "ttft_p90_ms": ms(ttfts, 90),
        "tpot_p50_ms": ms(tpots, 50),
        "tpot_p90_ms": ms(tpots, 90),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "wall_s": round(wall_s, 3),
        "lengths_exact": all(t.exact for t in timings),
        "inexact_requests": sum(not t.exact for t in timings),
        "counted_by": sorted({t.counted_by for t in timings}),
        "requests": [asdict(t) for t in timings],
    }
