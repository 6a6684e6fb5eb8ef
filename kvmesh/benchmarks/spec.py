"""`kvmesh bench spec`: decode tokens/s with and without speculative decoding, in one run.

Workloads: (a) chat prompts, (b) prompts whose answers are JSON objects or tool calls -- both
from the prompts held out of the EAGLE head's training. Methods: no speculation, n-gram prompt
lookup, the EAGLE head in-process, and the same head behind the draft service (a subprocess on
loopback: what the remote round trip costs per step). Greedy, so every method must emit the
same tokens; the bench checks it. Acceptance length = tokens emitted per verification step
(accepted drafts + the target's own token).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from kvmesh.engine.spec.prompts import chat_prompts, split, structured_prompts

METHODS = ("none", "ngram", "eagle", "eagle-remote")


def workloads(per: int) -> dict[str, list[str]]:
    _, held = split(chat_prompts() + structured_prompts(), 24)
    chat, structured = set(chat_prompts()), set(structured_prompts())
    return {"chat": [p for p in held if p in chat][:per],
            "structured": [p for p in held if p in structured][:per]}  # fmt: skip


def _engine(method: str, args: argparse.Namespace, draft_address: str):
    from kvmesh import LLM

    spec = {"none": "none", "ngram": "ngram"}.get(method, "eagle")
    return LLM(model=args.model, dtype="fp32", kv_cache_bytes=256 << 20, max_num_seqs=16,
               speculative=spec, num_speculative_tokens=args.num_speculative_tokens,
               draft_address=draft_address if method == "eagle-remote" else "")  # fmt: skip


def _run(llm, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list]:
    from kvmesh import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    convs = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    outs, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(convs), concurrency):
        llm.engine.block_manager.reset_prefix_cache()
        batch = llm.generate_ids(convs[i : i + concurrency], params)
        outs += [o.token_ids for o in batch]
        tokens += sum(len(o.token_ids) for o in batch)
    return tokens / (time.perf_counter() - start), outs


def _draft_service(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from kvmesh.mesh.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "draft", "--port",
                             str(port), "--model", args.model], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    return proc, f"127.0.0.1:{port}"


def run_spec_bench(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    loads = workloads(max(levels) if not args.quick else 2)
    proc, address = _draft_service(args)
    rows, remote_ms = [], []
    try:
        for method in METHODS:
            llm = _engine(method, args, address)
            for workload, prompts in loads.items():
                for level in levels:
                    stats = llm.engine.speculator.stats if llm.engine.speculator else None
                    before = (stats.steps, stats.accepted_tokens) if stats else (0, 0)
                    chosen = prompts[: max(level, 2 if args.quick else 4)]
                    tok_s, outs = _run(llm, chosen, level, args.max_tokens)
                    steps = stats.steps - before[0] if stats else 0
                    accepted = stats.accepted_tokens - before[1] if stats else 0
                    rows.append({"method": method, "workload": workload, "concurrency": level,
                                 "tok_s": round(tok_s, 2), "outputs": outs,
                                 "acceptance_length": round((accepted + steps) / steps, 2)
                                 if steps else None})  # fmt: skip
            proposer = llm.engine.speculator.proposer if llm.engine.speculator else None
            if method == "eagle-remote":
                trips = proposer.round_trips
                remote_ms = [round(1000 * sum(trips) / max(len(trips), 1), 2), len(trips)]
            del llm
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    report = _report(args, rows, remote_ms)
    print(report["markdown"])
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1))
    return 0 if report["lossless"] else 1


def _report(args: argparse.Namespace, rows: list[dict], remote_ms: list) -> dict:
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["method"] == "none"}
    lossless = all(r["outputs"] == base[(r["workload"], r["concurrency"])]["outputs"] for r in rows)
    lines = ["| workload | streams | method | tok/s | speedup | acceptance length |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ref = base[(r["workload"], r["concurrency"])]["tok_s"]
        r["speedup"] = round(r["tok_s"] / ref, 2)
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['tok_s']} | "
                     f"{r['speedup']}x | {r['acceptance_length'] or '-'} |")  # fmt: skip
    lines.append(f"\nremote draft round trip: {remote_ms[0] if remote_ms else '-'} ms per step "
                 f"(mean of {remote_ms[1] if remote_ms else 0} Propose calls); "
                 f"greedy outputs identical across methods: {lossless}")  # fmt: skip
    for r in rows:
        r.pop("outputs")
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "command": " ".join(["kvmesh", *sys.argv[1:]]), "model": args.model,
            "max_tokens": args.max_tokens, "num_speculative_tokens": args.num_speculative_tokens,
            "rows": rows, "remote_round_trip_ms": remote_ms, "lossless": lossless,
            "markdown": "\n".join(lines)}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="2 prompts per workload (smoke test)")
    p.add_argument("--output", default="")
