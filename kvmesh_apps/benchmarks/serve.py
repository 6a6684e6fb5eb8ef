"""`kvmesh bench serve`: a serving benchmark for any OpenAI-compatible server, or for the mesh.

`--url URL` measures a running server -- kvmesh, vLLM, llama.cpp's llama-server, SGLang -- over
its streaming OpenAI API (what, how and how lengths are kept exact: serve_suite.py and
serve_client.py): single-stream decode tok/s, TTFT on a ~500-token prompt, aggregate tok/s at
1/4/16/64 streams. `--model` defaults to the first model its `GET /v1/models` lists.

Without `--url` it starts the mesh (etcd + gateway + prefill and decode workers) and measures
the same, plus, for C in (1, 8, 16), rounds of C prompts through the in-process engine (`LLM.chat`,
same dtype and KV budget as a worker) each followed by the same prompts through the mesh
(serve_paired.py): mesh p50 / engine p50 for TPOT over the same rounds (targets: TPOT_TARGETS),
and each mesh process's CPU milliseconds per output token at every level (process_cpu.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvmesh import event_loop
from kvmesh.config.engine import DEFAULT_MODEL
from kvmesh.errors import ServeBenchError
from kvmesh.mesh.affinity import thread_kept_to
from kvmesh.routing import UP_LOCAL_PREFILL_TOKENS
from kvmesh_apps.benchmarks.process_cpu import CpuMeter
from kvmesh_apps.benchmarks.serve_client import Messages, Target, first_model, stream_one
from kvmesh_apps.benchmarks.serve_paired import measure_paired
from kvmesh_apps.benchmarks.serve_suite import (
    client_loops,
    level_prompts,
    measure_long_prompt,
    measure_single_stream,
    requests_for,
)
from kvmesh_apps.benchmarks.serve_suite import measure_level as measure_target_level
from kvmesh_apps.benchmarks.serve_suite import ms as _ms

__all__ = ["Messages", "ServeBenchError", "_ms", "level_prompts", "measure_level", "stream_one"]
OVERHEAD_LEVELS = (1, 8, 16)
TPOT_TARGETS = {1: 1.05, 8: 1.10, 16: 1.15}  # mesh / engine TPOT p50 (issue 14)
URL_LEVELS, MESH_LEVELS = "1,4,16,64", "1,8"
LONG_PROMPT_OUTPUT = 8  # tokens generated after each long prompt (TTFT is what counts)


def measure_level(
    url: str, model: str, concurrency: int, n_requests: int, max_tokens: int
) -> dict[str, Any]:
    """One concurrency level of chat requests against a running gateway at `url`."""
    return measure_target_level(Target(url, model), concurrency, n_requests, max_tokens, "mesh")


def overhead(mesh: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        return round(mesh[key] / engine[key], 3) if mesh[key] and engine[key] else None

    tpot = ratio("tpot_p50_ms")
    return {
        "concurrency": mesh["concurrency"],
        "tpot_p50_ratio": tpot,
        "ttft_p50_ratio": ratio("ttft_p50_ms"),
        "tok_s_ratio": ratio("output_tok_s"),
        "tpot_target": TPOT_TARGETS[mesh["concurrency"]],
        "tpot_within_target": tpot is not None and tpot <= TPOT_TARGETS[mesh["concurrency"]],
    }


# ---- report -----------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    where = report["url"] or f"the mesh ({report['prefill']} prefill + {report['decode']} decode)"
    lines = [
        f"{report['date']} {report['machine']}: {where}, model {report['model']}, "
        f"{report['max_tokens']} tokens per request, lengths exact: {report['lengths_exact']}",
        "| phase | streams | requests | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms "
        "| tok/s | exact lengths |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    single, long = report["single_stream"], report["long_prompt"]
    rows = [(f"single stream: {single['decode_tok_s']} decode tok/s", single)] if single else []
    if long:
        rows.append((f"long prompt ({_prompt_size(long)} tokens)", long))
    rows += [(r["path"], r) for r in report["levels"] + report["paired"] + report["engine"]]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['concurrency']} | {r['num_requests']} | {r['ttft_p50_ms']} "
            f"| {r['ttft_p90_ms']} | {r['tpot_p50_ms']} | {r['tpot_p90_ms']} "
            f"| {r['output_tok_s']} | {r['num_requests'] - r['inexact_requests']}"
            f"/{r['num_requests']} ({', '.join(r['counted_by'])}) |"
        )
    if report.get("bandwidth"):
        b = report["bandwidth"]
        lines.append(
            f"\nsingle stream / weight-bandwidth bound: {b['of_bound']} (median of "
            f"{b['of_bound_per_request']}: each request against the mean memory-read "
            f"ceiling before and after it, {' / '.join(map(str, b['ceiling_gbs']))} "
            f"GB/s, over {b['weight_bytes']} weight bytes; median bound "
            f"{b['bound_tok_s']} tok/s)"
        )
    if report.get("compute"):
        c = report["compute"]
        lines.append(
            f"\naggregate / compute bound ({c['bound_tok_s']} tok/s: bf16 GEMM "
            f"{c['gemm_gflops']} GFLOP/s, 2 FLOPs per weight element): "
            + ", ".join(f"{k} streams {v}" for k, v in c["of_bound"].items())
        )
    for r in report["levels"]:
        if r.get("cpu_ms_per_token"):
            split = ", ".join(f"{k} {v}" for k, v in r["cpu_ms_per_token"].items())
            lines.append(f"\nCPU ms per output token at {r['concurrency']} streams: {split}")
    for o in report["overhead"]:
        lines.append(
            f"| mesh / engine | {o['concurrency']} | | {o['ttft_p50_ratio']} | "
            f"| {o['tpot_p50_ratio']} (target <= {o['tpot_target']}) | | {o['tok_s_ratio']} | |"
        )
    return "\n".join(lines)


def _prompt_size(long: dict[str, Any]) -> str:
    sizes = sorted(set(long["prompt_tokens"] or []))
    if not sizes:
        return f"~{long['target_prompt_tokens']}"
    return f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"


# ---- entry points -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=None, help="a running OpenAI-compatible server (http://host:port[/v1])"
    )
    parser.add_argument(
        "--model", default=None, help=f"with --url: the first of /v1/models; else {DEFAULT_MODEL}"
    )
    parser.add_argument(
        "--concurrency", default=None, help=f"levels (--url: {URL_LEVELS}; else {MESH_LEVELS})"
    )
    parser.add_argument(
        "--requests-per-level", type=int, default=None, help="default: max(2 * C, 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--single-stream-requests", type=int, default=3, help="0: skip")
    parser.add_argument("--long-prompt-requests", type=int, default=3, help="0: skip")
    parser.add_argument("--long-prompt-tokens", type=int, default=500)
    parser.add_argument("--api", default="chat", choices=["chat", "completions"])
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    parser.add_argument(
        "--no-min-tokens", action="store_true", help="do not send min_tokens (strict servers)"
    )
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (no --url)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (no --url)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="no --url")
    parser.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "fp32", "bf16", "int4"],
        help="no --url: the workers' and the engine's weights",
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=UP_LOCAL_PREFILL_TOKENS,
        help="no --url: decode prefills prompts up to this many tokens itself "
        "(default: kvmesh up's)",
    )
    parser.add_argument(
        "--decode-lead-cpu",
        default="auto",
        metavar="auto|off|CPU",
        help="no --url: kvmesh up's --decode-lead-cpu (the client then keeps "
        "off that CPU, as a remote one would)",
    )
    parser.add_argument("--output", default=None, help="also write the JSON report here")


def run_serve_bench(args: argparse.Namespace) -> int:
    default_levels = URL_LEVELS if args.url else MESH_LEVELS
    levels = [int(c) for c in (args.concurrency or default_levels).split(",")]
    model = args.model or (first_model(args.url, args.api_key) if args.url else DEFAULT_MODEL)
    compared = [] if args.url else [c for c in levels if c in OVERHEAD_LEVELS]
    suite, engine, paired = _measure(args, model, levels, compared)
    phases = [suite["single_stream"], suite["long_prompt"], *suite["levels"]]
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "command": shlex.join(["kvmesh", *sys.argv[1:]]),
        "url": args.url,
        "model": model,
        "api": args.api,
        "dtype": None if args.url else args.dtype,
        "weights": None if args.url else args.weights,
        "prefill": None if args.url else args.prefill,
        "decode": None if args.url else args.decode,
        "max_tokens": args.max_tokens,
        **suite,
        "lengths_exact": all(p["lengths_exact"] for p in phases if p),
        "engine": list(engine.values()),
        "paired": list(paired.values()),
        "overhead": [overhead(paired[c], e) for c, e in engine.items()],
    }
    print(markdown(report), flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


def _measure(args: argparse.Namespace, model: str, levels: list[int], compared: list[int]):
    """(suite, engine, paired): the suite against the server or the mesh; without --url also the
    `compared` levels through the engine and the mesh, request by request."""
    if args.url:
        return measure_suite(_target(args, args.url, model), args, levels, "server"), {}, {}
    from kvmesh.mesh.launcher import Mesh, UpOptions
    from kvmesh.mesh.up_config import worker_configs

    options = UpOptions(
        workers=worker_configs(
            "--model",
            model,
            "--dtype",
            args.dtype,
            "--weights",
            args.weights,
            "--local-prefill-tokens",
            str(args.local_prefill_tokens),
        ),
        prefill=args.prefill,
        decode=args.decode,
        decode_lead_cpu=args.decode_lead_cpu,
    )
    mesh = Mesh(options)
    try:
        mesh.start()
        target = _target(args, f"http://127.0.0.1:{mesh.http_port}", model)
        engine, paired = {}, {}
        client_cpus = mesh.cpus  # off the decode engine thread's lead CPU, as a remote client
        if compared:
            with thread_kept_to(client_cpus):
                event_loop.run(client_loops(target, list(level_prompts(0, 2)), 2, 8))  # warm-up
            engine, paired = measure_paired(
                target,
                args.dtype,
                compared,
                args.requests_per_level,
                args.max_tokens,
                args.weights,
                client_cpus,
            )
        from kvmesh_apps.benchmarks.kernels import Ceiling
        from kvmesh_apps.benchmarks.serve_bounds import measure_bounds

        probe = Ceiling()  # with the mesh idle, beside each single-stream request
        suite = measure_suite(
            target, args, levels, "mesh", CpuMeter(mesh.pids()), probe, client_cpus
        )
        del probe
        suite.update(measure_bounds(suite, model, args.dtype, args.weights))
        return suite, engine, paired
    finally:
        mesh.stop()


def _target(args: argparse.Namespace, url: str, model: str) -> Target:
    return Target(url, model, args.api, args.api_key, min_tokens=not args.no_min_tokens)


def measure_suite(
    target: Target,
    args: argparse.Namespace,
    levels: list[int],
    path: str,
    meter: CpuMeter | None = None,
    probe: Callable[[], float] | None = None,
    client_cpus: frozenset[int] | None = None,
) -> dict[str, Any]:
    """Warm-up, then single stream, long prompt and every level, one after the other; with a
    meter, each level's CPU milliseconds per output token of every process; with a probe, the
    memory-read ceiling beside each single-stream request (on every CPU); the client on
    `client_cpus` (None: where it is)."""
    if probe is not None and client_cpus is not None:
        probe = functools.partial(_on_cpus, frozenset(os.sched_getaffinity(0)), probe)
    with thread_kept_to(client_cpus):
        return _suite(target, args, levels, path, meter, probe)


def _on_cpus(cpus: frozenset[int], probe: Callable[[], float]) -> float:
    with thread_kept_to(cpus):
        return probe()


def _suite(
    target: Target,
    args: argparse.Namespace,
    levels: list[int],
    path: str,
    meter: CpuMeter | None,
    probe: Callable[[], float] | None,
) -> dict[str, Any]:
    event_loop.run(client_loops(target, list(level_prompts(0, 2)), 2, 8))
    n, tokens = args.requests_per_level, args.max_tokens
    single = long = None
    if args.single_stream_requests:
        single = measure_single_stream(target, args.single_stream_requests, tokens, probe)
    if args.long_prompt_requests:
        long = measure_long_prompt(
            target, args.long_prompt_requests, args.long_prompt_tokens, LONG_PROMPT_OUTPUT
        )
    rows = []
    for c in levels:
        before = meter.sample() if meter else {}
        rows.append(measure_target_level(target, c, requests_for(c, n), tokens, path))
        if meter:
            rows[-1]["cpu_ms_per_token"] = meter.per_token(
                before, meter.sample(), rows[-1]["output_tokens"]
            )
    return {"single_stream": single, "long_prompt": long, "levels": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh_apps.benchmarks.serve", description=__doc__
    )
    add_arguments(parser)
    from kvmesh.log import configure_logging

    configure_logging("serve-bench")
    return run_serve_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
