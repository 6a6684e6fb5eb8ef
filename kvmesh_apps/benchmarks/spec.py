"""`kvmesh bench spec`: decode tokens/s with and without speculative decoding, in one run.

Workloads: (a) chat prompts, (b) prompts whose answers are JSON objects or tool calls -- both
from the prompts held out of the EAGLE head's training (cycled where a concurrency needs more).
Methods: no speculation; n-gram prompt lookup and the EAGLE head in-process, both under the
adaptive policy (spec/policy.py); `eagle-fixed`, the head drafting the full length every step
(no policy); `eagle-remote`, the head behind the draft service (a subprocess on loopback).
Every engine is built once; each batch of prompts runs on all of them in lockstep (one engine
step of each method in turn, each timed alone), so a neighbour's burst on a shared machine
slows every method alike and the ratios compare steps taken a fraction of a second apart.
Greedy, so every method must emit the same tokens; the bench checks it. Acceptance length =
tokens emitted per verification (accepted drafts + the target's own token).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from kvmesh.engine.spec.prompts import chat_prompts, split, structured_prompts
from kvmesh_apps.benchmarks.lockstep import lockstep

METHODS = ("none", "ngram", "eagle", "eagle-fixed", "eagle-remote")
COUNTERS = (
    "steps",
    "draft_tokens",
    "accepted_tokens",
    "policy_steps",
    "off_steps",
    "shadow_drafts",
    "shadow_hits",
)
_request_ids = itertools.count()


def workloads(per: int) -> dict[str, list[str]]:
    """`per` prompts of each workload, the held-out ones cycled."""
    _, held = split(chat_prompts() + structured_prompts(), 24)
    chat, structured = set(chat_prompts()), set(structured_prompts())
    pools = {
        "chat": [p for p in held if p in chat],
        "structured": [p for p in held if p in structured],
    }
    return {name: [pool[i % len(pool)] for i in range(per)] for name, pool in pools.items()}


def _engine(method: str, args: argparse.Namespace, draft_address: str, max_seqs: int):
    from kvmesh import LLM
    from kvmesh.engine.spec.policy import FixedPolicy
    from kvmesh.mesh.draft_client import RemoteProposer

    spec = {"none": "none", "ngram": "ngram"}.get(method, "eagle")
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_num_seqs=max_seqs,
        speculative=spec,
        num_speculative_tokens=args.num_speculative_tokens,
        draft=RemoteProposer(draft_address) if method == "eagle-remote" else None,
    )
    if method == "eagle-fixed":
        llm.engine.speculator.policy = FixedPolicy(args.num_speculative_tokens)
    return llm


def _lockstep(engines: dict, prompts: list[str], max_tokens: int) -> dict[str, dict]:
    """`prompts` at once on every engine, one step of each in turn (order alternating), so a
    neighbour's burst on a shared machine slows every method alike. Per engine: tokens, the
    wall and process CPU seconds of its own steps, outputs, and its counters' increase."""
    from kvmesh import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs: dict[str, dict] = {}
    for name, llm in engines.items():
        llm.engine.block_manager.reset_prefix_cache()
        ids = [f"{name}-{next(_request_ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts, strict=True):
            conv = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            llm.engine.add_request(rid, conv, params)
        runs[name] = {
            "out": {rid: [] for rid in ids},
            "seconds": 0.0,
            "cpu_s": 0.0,
            "before": _counters(llm),
        }

    def collect(name: str, outputs: list) -> None:
        for out in outputs:
            runs[name]["out"][out.request_id] += out.new_token_ids

    spent = lockstep({name: llm.engine for name, llm in engines.items()}, collect)
    for name, run in runs.items():
        run["seconds"], run["cpu_s"] = spent[name].seconds, spent[name].cpu_s
    return {name: _result(run, engines[name]) for name, run in runs.items()}


def _result(run: dict, llm) -> dict:
    outs = list(run["out"].values())
    delta = {k: v - run["before"][k] for k, v in _counters(llm).items()}
    return {
        "tokens": sum(map(len, outs)),
        "seconds": run["seconds"],
        "cpu_s": run["cpu_s"],
        "outputs": outs,
        **delta,
    }


def _counters(llm) -> dict[str, int]:
    stats = llm.engine.speculator.stats if llm.engine.speculator else None
    return {name: getattr(stats, name) if stats else 0 for name in COUNTERS}


def _draft_service(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from kvmesh.mesh.ports import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "serve",
            "draft",
            "--port",
            str(port),
            "--model",
            args.model,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, f"127.0.0.1:{port}"


def run_spec_bench(args: argparse.Namespace) -> int:
    if args.cost_profile:
        from kvmesh_apps.benchmarks.spec_cost import run_cost_profile

        return run_cost_profile(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    if "none" not in methods or any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods: a comma list of {METHODS}, including none")
    proc, address = _draft_service(args) if "eagle-remote" in methods else (None, "")
    try:
        engines = {m: _engine(m, args, address, max(levels)) for m in methods}
        _lockstep(engines, workloads(2)["chat"], 16)  # warm-up
        rows = _sweep(engines, levels, args)
        remote = engines.get("eagle-remote")
        trips = list(remote.engine.speculator.proposer.round_trips) if remote else []
        remote_ms = [round(1000 * sum(trips) / max(len(trips), 1), 2), len(trips)]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    report = _report(args, rows, remote_ms)
    print(report["markdown"])
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1))
    return 0 if report["lossless"] else 1


def _sweep(engines: dict, levels: list[int], args: argparse.Namespace) -> list[dict]:
    """One row per (workload, concurrency, method): each batch of `concurrency` prompts runs
    on every method's engine in lockstep."""
    rows = []
    for workload in args.workloads.split(","):
        for level in levels:
            prompts = workloads(max(level, args.min_prompts))[workload]
            runs: dict[str, list[dict]] = {m: [] for m in engines}
            for _ in range(args.rounds):
                for i in range(0, len(prompts), level):
                    unit = _lockstep(engines, prompts[i : i + level], args.max_tokens)
                    for method, result in unit.items():
                        runs[method].append(result)
            rows += [_row(workload, level, m, r, runs["none"]) for m, r in runs.items()]
            print(_line(rows[-len(engines) :]), flush=True)
    return rows


def _row(workload: str, level: int, method: str, runs: list[dict], base: list[dict]) -> dict:
    total = {k: sum(r[k] for r in runs) for k in ("tokens", "seconds", "cpu_s", *COUNTERS)}
    ref = {k: sum(r[k] for r in base) for k in ("tokens", "seconds", "cpu_s")}
    paired = [
        (r["tokens"] / r["seconds"]) / (b["tokens"] / b["seconds"])
        for r, b in zip(runs, base, strict=True)
    ]
    steps, drafts, policy = total["steps"], total["draft_tokens"], total["policy_steps"]
    return {
        "workload": workload,
        "concurrency": level,
        "method": method,
        "tok_s": round(total["tokens"] / total["seconds"], 2),
        "ratio": round(_rate(total, "seconds") / _rate(ref, "seconds"), 3),
        "ratio_cpu": round(_rate(total, "cpu_s") / _rate(ref, "cpu_s"), 3),
        "run_ratios": [round(r, 3) for r in paired],
        "accepted_per_draft": round(total["accepted_tokens"] / drafts, 3) if drafts else None,
        "acceptance_length": round((total["accepted_tokens"] + steps) / steps, 2)
        if steps
        else None,
        "drafts_per_step": round(drafts / policy, 2) if policy else None,
        "off_steps": round(total["off_steps"] / policy, 3) if policy else None,
        "shadow_hit_rate": round(total["shadow_hits"] / total["shadow_drafts"], 3)
        if total["shadow_drafts"]
        else None,
        "lossless": all(r["outputs"] == b["outputs"] for r, b in zip(runs, base, strict=True)),
    }


def _rate(total: dict, clock: str) -> float:
    return total["tokens"] / total[clock]


def _line(rows: list[dict]) -> str:
    return "  ".join(
        f"{r['workload']}@{r['concurrency']} {r['method']}: {r['tok_s']} tok/s "
        f"x{r['ratio']} (cpu x{r['ratio_cpu']})"
        for r in rows
    )


def _report(args: argparse.Namespace, rows: list[dict], remote_ms: list) -> dict:
    lines = [
        "| workload | streams | method | tok/s | vs none (wall) | vs none (CPU time) | "
        "accepted / draft | acceptance length | drafts / step | steps off | shadow hits |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['tok_s']} | "
            f"{r['ratio']}x | {r['ratio_cpu']}x | {_dash(r['accepted_per_draft'])} | "
            f"{_dash(r['acceptance_length'])} | {_dash(r['drafts_per_step'])} | "
            f"{_dash(r['off_steps'])} | {_dash(r['shadow_hit_rate'])} |"
        )
    lossless = all(r["lossless"] for r in rows)
    lines.append(
        f"\nremote draft round trip: {remote_ms[0]} ms per step (mean of {remote_ms[1]} "
        f"Propose calls); greedy outputs identical across methods: {lossless}"
    )
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "command": " ".join(["kvmesh", *sys.argv[1:]]),
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "rounds": args.rounds,
        "rows": rows,
        "remote_round_trip_ms": remote_ms,
        "lossless": lossless,
        "markdown": "\n".join(lines),
    }


def _dash(value) -> str:
    return "-" if value is None else str(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="every engine's compute dtype (and weights)",
    )
    p.add_argument("--concurrency", default="1,8,16,64", help="streams at once, comma list")
    p.add_argument("--workloads", default="chat,structured", help="chat and/or structured")
    p.add_argument(
        "--methods",
        default="none,ngram,eagle,eagle-remote",
        help=f"comma list of {', '.join(METHODS)}",
    )
    p.add_argument("--rounds", type=int, default=2, help="passes over each cell's prompts")
    p.add_argument(
        "--min-prompts",
        type=int,
        default=4,
        help="prompts per cell at least (1 stream: run one after another)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--kv-cache-mib", type=int, default=768)
    p.add_argument(
        "--cost-profile",
        action="store_true",
        help="instead: step seconds by batch and drafts per sequence (the policy's prior shape)",
    )
    p.add_argument("--output", default="")
