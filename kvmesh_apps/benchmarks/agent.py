"""`kvmesh bench serve --workload agent`: prompt-cache hits and TTFT for multi-turn agent sessions.

S sessions run concurrently, each T turns in order. Every session starts from one shared system
prompt (a deterministic tool manual, ~1,000 tokens); each turn appends a user message (a tool
result, distinct per session and turn), streams a reply (greedy, `max_tokens` fixed, EOS ignored)
and appends the reply, so the history grows. Every request sends `x-session-affinity:
session-<i>`. Per request: prompt_tokens, cached_tokens (usage.prompt_tokens_details) and TTFT
(first content delta - send).

The workload runs twice, each time on a fresh mesh: `--routing cache-aware`, then `--routing
least-load` (the baseline that ignores affinity and prefixes). Reported per mode: hit ratio =
sum(cached) / sum(prompt) (target >= 0.80 for cache-aware), TTFT p50/p90, TTFT p50 of turn 1 vs
turns >= 2, and cache-aware TTFT p50 / least-load TTFT p50 (target <= 0.30).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from kvmesh import event_loop
from kvmesh_apps.benchmarks.serve import Messages, ServeBenchError, _ms, level_prompts, stream_one

MODES = ("cache-aware", "least-load")
HIT_RATIO_TARGET = 0.80
TTFT_RATIO_TARGET = 0.30
WORKER_KV_CACHE_MIB = 256
TOOLS = (
    ("read_file", "path", "Return the text of a file in the workspace."),
    ("write_file", "path, text", "Replace a file's text; create folders as needed."),
    ("grep", "pattern, path", "List the lines matching a regular expression, with line numbers."),
    ("run_tests", "selector", "Run the test suite or the selected tests; return the summary."),
    ("list_dir", "path", "List a folder's entries, folders first, sorted by name."),
    ("apply_patch", "diff", "Apply a unified diff to the workspace; fail on any conflict."),
    ("search_docs", "query", "Search the project documentation; return the five best passages."),
    ("run_shell", "command", "Run a shell command with a 60 second limit; return its output."),
)


@dataclass(frozen=True)
class Workload:
    model: str = "smollm2-135m"
    sessions: int = 16
    turns: int = 8
    max_tokens: int = 16
    system_tokens: int = 1000  # approximate size of the shared system prompt

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.max_tokens, self.system_tokens) < 1:
            raise ValueError(f"every Workload field must be >= 1: {self}")


@dataclass(frozen=True)
class Reply:
    """One streamed chat completion."""

    text: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class TurnRecord:
    session: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


# ---- workload ---------------------------------------------------------------------------------


def system_prompt(approx_tokens: int = 1000) -> str:
    """A deterministic tool manual of about `approx_tokens` tokens (~3.6 characters each)."""
    lines = ["You are a coding agent. Call one tool per step and explain your choice briefly."]
    i = 0
    while sum(len(line) for line in lines) < 3.6 * approx_tokens:
        name, params, purpose = TOOLS[i % len(TOOLS)]
        lines.append(
            f"Tool {i + 1}: {name}_v{i // len(TOOLS) + 1}({params}). {purpose} "
            f"Errors come back as text starting with 'error:'; retry at most twice."
        )
        i += 1
    return "\n".join(lines)


def user_message(session: int, turn: int) -> str:
    name = TOOLS[(session + turn) % len(TOOLS)][0]
    return (
        f"Session {session}, step {turn}: {name} returned {3 * session + turn} matches in "
        f"src/module_{session}_{turn}.py. What should the next step be?"
    )


async def stream_reply(
    client: httpx.AsyncClient, url: str, w: Workload, messages: Messages, session_id: str
) -> Reply:
    body = {
        "model": w.model,
        "messages": messages,
        "max_tokens": w.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-session-affinity": session_id}
    start = time.perf_counter()
    first, parts, usage = None, [], None
    request = client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers)
    async with request as response:
        if response.status_code != 200:
            await response.aread()
            raise ServeBenchError(f"HTTP {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise ServeBenchError(f"in-band error: {chunk['error']}")
            text = "".join(c.get("delta", {}).get("content") or "" for c in chunk["choices"])
            if text:
                first = first or time.perf_counter()
                parts.append(text)
            usage = chunk.get("usage") or usage
    if first is None or usage is None:
        raise ServeBenchError("stream ended without content or without a usage chunk")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Reply("".join(parts), first - start, usage["prompt_tokens"], cached)


async def _session(
    client: httpx.AsyncClient, url: str, w: Workload, system: str, session: int
) -> list[TurnRecord]:
    messages = [{"role": "system", "content": system}]
    records = []
    for turn in range(1, w.turns + 1):
        messages.append({"role": "user", "content": user_message(session, turn)})
        reply = await stream_reply(client, url, w, messages, f"session-{session}")
        messages.append({"role": "assistant", "content": reply.text})
        records.append(
            TurnRecord(session, turn, reply.prompt_tokens, reply.cached_tokens, reply.ttft_s)
        )
    return records


async def _sessions(url: str, w: Workload) -> list[TurnRecord]:
    system = system_prompt(w.system_tokens)
    limits = httpx.Limits(max_connections=w.sessions, max_keepalive_connections=w.sessions)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:
        per_session = await asyncio.gather(
            *(_session(client, url, w, system, s) for s in range(w.sessions))
        )
    return [r for records in per_session for r in records]


def run_workload(url: str, workload: Workload) -> list[TurnRecord]:
    """Every session of `workload`, concurrently, against a running gateway (http://host:port)."""
    return event_loop.run(_sessions(url, workload))


# ---- summary and report -----------------------------------------------------------------------


def hit_ratio(records: list[TurnRecord]) -> float:
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompt if prompt else 0.0


def summarize(mode: str, records: list[TurnRecord], wall_s: float) -> dict[str, Any]:
    ttfts = [r.ttft_s for r in records]
    return {
        "routing": mode,
        "num_requests": len(records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "hit_ratio": round(hit_ratio(records), 3),
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p90_ms": _ms(ttfts, 90),
        "ttft_p50_turn1_ms": _ms([r.ttft_s for r in records if r.turn == 1], 50),
        "ttft_p50_later_ms": _ms([r.ttft_s for r in records if r.turn >= 2], 50),
        "wall_s": round(wall_s, 1),
        "requests": [asdict(r) for r in records],
    }


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    aware, least = rows.get("cache-aware"), rows.get("least-load")
    ratio = None
    if aware and least and aware["ttft_p50_ms"] and least["ttft_p50_ms"]:
        ratio = round(aware["ttft_p50_ms"] / least["ttft_p50_ms"], 3)
    hit = aware["hit_ratio"] if aware else None
    return {
        "ttft_p50_ratio": ratio,
        "ttft_within_target": ratio is not None and ratio <= TTFT_RATIO_TARGET,
        "hit_ratio_within_target": hit is not None and hit >= HIT_RATIO_TARGET,
    }


def markdown(report: dict[str, Any]) -> str:
    c = report["comparison"]
    lines = [
        f"{report['date']} {report['machine']}, model {report['model']}, "
        f"{report['prefill']} prefill + {report['decode']} decode, {report['sessions']} sessions "
        f"x {report['turns']} turns, system prompt {report['system_prompt_tokens']} tokens, "
        f"{report['max_tokens']} tokens per reply",
        "| routing | requests | prompt tok | cached tok | hit ratio | TTFT p50 ms | TTFT p90 ms "
        "| TTFT p50 turn 1 | TTFT p50 turns >= 2 | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["modes"]:
        lines.append(
            f"| {r['routing']} | {r['num_requests']} | {r['prompt_tokens']} "
            f"| {r['cached_tokens']} | {r['hit_ratio']} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} "
            f"| {r['ttft_p50_turn1_ms']} | {r['ttft_p50_later_ms']} | {r['wall_s']} |"
        )
    lines.append(
        f"cache-aware / least-load TTFT p50: {c['ttft_p50_ratio']} (target <= "
        f"{TTFT_RATIO_TARGET}); cache-aware hit ratio target >= {HIT_RATIO_TARGET}: "
        f"{'met' if c['hit_ratio_within_target'] else 'missed'}"
    )
    return "\n".join(lines)


# ---- entry points -----------------------------------------------------------------------------


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent-only flags (what `kvmesh bench serve` lacks)."""
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=8, help="turns per session")
    parser.add_argument("--system-tokens", type=int, default=1000, help="shared system prompt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--output", default=None, help="also write the JSON report here")
    parser.add_argument("--kvstore", default="builtin", choices=["builtin", "mooncake", "none"])
    add_workload_arguments(parser)


def run_agent_bench(args: argparse.Namespace) -> int:
    rows = {mode: _measure_mode(args, mode) for mode in MODES}
    turn1 = [r for r in rows["cache-aware"]["requests"] if r["turn"] == 1]
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "model": args.model,
        "prefill": args.prefill,
        "decode": args.decode,
        "sessions": args.sessions,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "system_prompt_tokens": min((r["prompt_tokens"] for r in turn1), default=None),
        "modes": list(rows.values()),
        "comparison": compare(rows),
    }
    print(markdown(report), flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


def _measure_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One fresh mesh per mode, stopped before the next starts."""
    from kvmesh.mesh.launcher import Mesh, UpOptions
    from kvmesh.mesh.up_config import gateway_config, worker_configs

    options = UpOptions(
        workers=worker_configs("--model", args.model, "--kv-cache-mib", str(WORKER_KV_CACHE_MIB)),
        prefill=args.prefill,
        decode=args.decode,
        gateway=gateway_config("--routing", mode),
        kvstore=getattr(args, "kvstore", "builtin"),
    )
    mesh = Mesh(options)
    try:
        mesh.start()
        url = f"http://127.0.0.1:{mesh.http_port}"
        event_loop.run(_warm_up(url, args.model, 2 * max(args.prefill, args.decode)))
        start = time.perf_counter()
        workload = Workload(
            args.model, args.sessions, args.turns, args.max_tokens, args.system_tokens
        )
        records = run_workload(url, workload)
        return summarize(mode, records, time.perf_counter() - start)
    finally:
        mesh.stop()


async def _warm_up(url: str, model: str, n: int) -> None:
    """Prompts unrelated to the workload, so nothing of it is cached before it runs."""
    await asyncio.gather(*(stream_one(url, model, p, 4) for p in level_prompts(0, n)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh_apps.benchmarks.agent", description=__doc__
    )
    add_arguments(parser)
    from kvmesh.log import configure_logging

    configure_logging("agent-bench")
    return run_agent_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
