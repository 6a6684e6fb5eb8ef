"""`kvmesh bench serve`: TTFT, TPOT and tokens/s through the gateway's OpenAI REST API.

For each concurrency C, C client loops stream `POST /v1/chat/completions` (greedy, EOS ignored,
`max_tokens` fixed) until N requests are done. Per request: TTFT = first content delta - send;
TPOT = (last content delta - first) / (tokens - 1), tokens from the final usage chunk. tok/s =
all output tokens / wall time of the level.

Mesh overhead (only when this command starts the mesh): for C in (1, 8) the same prompts run
first through the in-process engine (`LLM.chat`, C conversations at a time, same dtype and KV
budget as a worker), then the engine is dropped and the mesh started, so the two never share
the CPU. Reported as mesh p50 / engine p50 for TPOT (target <= 1.10) and TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvmesh.benchmarks.offline import TOPICS
from kvmesh.errors import ServeBenchError

OVERHEAD_LEVELS = (1, 8)
TPOT_TARGET = 1.10
WORKER_KV_CACHE_BYTES = 512 << 20  # `kvmesh serve decode|prefill` default --kv-cache-mib
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request; tpot_s is None when it produced a single token."""

    ttft_s: float
    tpot_s: float | None
    tokens: int


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


# ---- mesh: streaming clients ------------------------------------------------------------------


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, messages: Messages, max_tokens: int
) -> RequestTiming:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = tokens = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise ServeBenchError(f"HTTP {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise ServeBenchError(f"in-band error: {chunk['error']}")
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = last if first is None else first
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or last is None or not tokens:
        raise ServeBenchError("stream ended without content or without a usage chunk")
    return RequestTiming(first - start, _tpot(last - first, tokens), tokens)


async def _client_loops(
    url: str, model: str, prompts: list[Messages], concurrency: int, max_tokens: int
) -> tuple[list[RequestTiming], float]:
    """C loops, each taking the next prompt until none is left; returns timings and wall time."""
    todo = deque(enumerate(prompts))
    timings: list[RequestTiming | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:

        async def loop() -> None:
            while todo:
                i, messages = todo.popleft()
                timings[i] = await stream_one(client, url, model, messages, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return [t for t in timings if t is not None], wall


def measure_level(
    url: str, model: str, concurrency: int, n_requests: int, max_tokens: int
) -> dict[str, Any]:
    """One concurrency level against a running gateway at `url` (http://host:port)."""
    prompts = level_prompts(concurrency, n_requests)
    timings, wall = asyncio.run(_client_loops(url, model, prompts, concurrency, max_tokens))
    return summarize("mesh", concurrency, timings, wall)


# ---- in-process engine ------------------------------------------------------------------------


def measure_engine(
    model: str, dtype: str, levels: list[int], requests_per_level: int | None, max_tokens: int
) -> dict[int, dict[str, Any]]:
    """The same prompts through `LLM.chat`, C conversations at a time; the LLM is freed after."""
    from kvmesh import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, kv_cache_bytes=WORKER_KV_CACHE_BYTES)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.chat(level_prompts(0, 2), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    results = {}
    for c in levels:
        prompts = level_prompts(c, requests_for(c, requests_per_level))
        timings, wall = [], 0.0
        for i in range(0, len(prompts), c):
            start = time.perf_counter()
            outs = llm.chat(prompts[i : i + c], params)
            wall += time.perf_counter() - start
            timings += [_engine_timing(o) for o in outs]
        results[c] = summarize("engine", c, timings, wall)
    del llm
    gc.collect()
    return results


def _engine_timing(out: Any) -> RequestTiming:
    n = len(out.token_ids)
    return RequestTiming(out.ttft_s, _tpot(out.total_s - out.ttft_s, n), n)


# ---- summary and report -----------------------------------------------------------------------


def _tpot(decode_s: float, tokens: int) -> float | None:
    return decode_s / (tokens - 1) if tokens > 1 else None


def _ms(values: list[float], q: float) -> float | None:
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
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p90_ms": _ms(ttfts, 90),
        "tpot_p50_ms": _ms(tpots, 50),
        "tpot_p90_ms": _ms(tpots, 90),
        "output_tok_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "wall_s": round(wall_s, 3),
        "requests": [asdict(t) for t in timings],
    }


def overhead(mesh: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        return round(mesh[key] / engine[key], 3) if mesh[key] and engine[key] else None

    tpot = ratio("tpot_p50_ms")
    return {
        "concurrency": mesh["concurrency"],
        "tpot_p50_ratio": tpot,
        "ttft_p50_ratio": ratio("ttft_p50_ms"),
        "tok_s_ratio": ratio("output_tok_s"),
        "tpot_within_target": tpot is not None and tpot <= TPOT_TARGET,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['date']} {report['machine']}, model {report['model']} {report['dtype']}, "
        f"{report['prefill']} prefill + {report['decode']} decode, "
        f"{report['max_tokens']} tokens per request",
        "| path | concurrency | requests | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms "
        "| tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["mesh"] + report["engine"]:
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['num_requests']} | {r['ttft_p50_ms']} "
            f"| {r['ttft_p90_ms']} | {r['tpot_p50_ms']} | {r['tpot_p90_ms']} "
            f"| {r['output_tok_s']} |"
        )
    for o in report["overhead"]:
        lines.append(
            f"| mesh / engine | {o['concurrency']} | | {o['ttft_p50_ratio']} | "
            f"| {o['tpot_p50_ratio']} (target <= {TPOT_TARGET}) | | {o['tok_s_ratio']} |"
        )
    return "\n".join(lines)


# ---- entry points -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels to sweep")
    parser.add_argument(
        "--requests-per-level", type=int, default=None, help="default: max(2 * C, 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--url", default=None, help="use this running gateway (http://host:port), no engine rows"
    )
    parser.add_argument("--output", default=None, help="also write the JSON report here")


def run_serve_bench(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    compared = [c for c in levels if c in OVERHEAD_LEVELS]
    engine = (
        {}
        if args.url
        else measure_engine(
            args.model, args.dtype, compared, args.requests_per_level, args.max_tokens
        )
    )
    mesh_rows = _measure_mesh(args, levels)
    by_level = {r["concurrency"]: r for r in mesh_rows}
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "model": args.model,
        "dtype": args.dtype,
        "prefill": None if args.url else args.prefill,
        "decode": None if args.url else args.decode,
        "url": args.url,
        "max_tokens": args.max_tokens,
        "mesh": mesh_rows,
        "engine": list(engine.values()),
        "overhead": [overhead(by_level[c], e) for c, e in engine.items()],
    }
    print(markdown(report), flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


def _measure_mesh(args: argparse.Namespace, levels: list[int]) -> list[dict[str, Any]]:
    if args.url:
        return sweep(args.url.rstrip("/"), args, levels)
    from kvmesh.mesh.launcher import Mesh, UpOptions

    options = UpOptions(
        model=args.model,
        prefill=args.prefill,
        decode=args.decode,
        worker_args=("--dtype", args.dtype),
    )
    mesh = Mesh(options)
    try:
        mesh.start()
        return sweep(f"http://127.0.0.1:{mesh.http_port}", args, levels)
    finally:
        mesh.stop()


def sweep(url: str, args: argparse.Namespace, levels: list[int]) -> list[dict[str, Any]]:
    asyncio.run(_client_loops(url, args.model, level_prompts(0, 2), 2, 8))  # warm-up
    n = args.requests_per_level
    return [measure_level(url, args.model, c, requests_for(c, n), args.max_tokens) for c in levels]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.benchmarks.serve", description=__doc__)
    add_arguments(parser)
    from kvmesh.log import configure_logging

    configure_logging("serve-bench")
    return run_serve_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
