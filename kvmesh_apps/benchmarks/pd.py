"""`kvmesh bench pd`: the seed's P/D result -- steady decode streams plus long prompts arriving at
a fixed rate (pd_workload.py), on the same CPUs, served two ways, one fresh mesh each:

- colocated: ONE decode worker on all the CPUs (a torch thread each) and no prefill worker, so
  it prefills every prompt itself, in chunks (the scheduler's token budget) batched with the
  running streams' decode steps;
- disaggregated: a prefill worker pinned to the first half of the CPUs, a decode worker to the
  rest (one torch thread per CPU each), KV pages handed over by the transfer engine, the
  gateway's token-aware routing (`--routing least-load`: fewest tokens in flight).

Reported side by side: p50/p90 TPOT, ITL and TTFT of the steady streams, TTFT of the long
prompts, and disaggregated / colocated for each; the issue's target is p90 TPOT <= 0.5x.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Any

from kvmesh import event_loop
from kvmesh.errors import ServeBenchError
from kvmesh.mesh.affinity import checked_cpus, format_cpus
from kvmesh_apps.benchmarks.pd_workload import PdWorkload, drive, ratios, summarize_run
from kvmesh_apps.benchmarks.report import BenchRun, write_report
from kvmesh_apps.benchmarks.serve_client import Target
from kvmesh_apps.benchmarks.serve_suite import client_loops, level_prompts, long_prompt

TPOT_P90_TARGET = 0.5
MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Placement:
    """One mode's workers and the CPUs of each role."""

    mode: str
    prefill: int
    decode: int
    cpus: dict[str, str]


def placements(cpus: frozenset[int]) -> dict[str, Placement]:
    """Colocated on all of `cpus`; disaggregated: prefill on the first half, decode the rest."""
    if len(cpus) < 2:
        raise ServeBenchError(f"bench pd needs at least 2 CPUs, got {format_cpus(cpus)}")
    ordered = sorted(cpus)
    half = len(ordered) // 2
    return {
        "colocated": Placement("colocated", 0, 1, {"decode": format_cpus(ordered)}),
        "disaggregated": Placement(
            "disaggregated",
            1,
            1,
            {"prefill": format_cpus(ordered[:half]), "decode": format_cpus(ordered[half:])},
        ),
    }


def default_cpus() -> str:
    """The first two CPUs this process may use."""
    return format_cpus(sorted(os.sched_getaffinity(0))[:2])


def workload_from(args: argparse.Namespace) -> PdWorkload:
    return PdWorkload(
        streams=args.streams,
        stream_tokens=args.stream_tokens,
        long_prompts=args.long_prompts,
        long_prompt_tokens=args.long_prompt_tokens,
        long_output_tokens=args.long_output_tokens,
        interval_s=args.interval,
        first_long_s=args.first_long,
    )


def run_mode(placement: Placement, args: argparse.Namespace, w: PdWorkload) -> dict[str, Any]:
    """A fresh mesh for `placement`, warmed up, then the workload once; stopped after."""
    from kvmesh.mesh.launcher import Mesh, UpOptions
    from kvmesh.mesh.up_config import gateway_config, worker_configs

    worker_args = ("--dtype", args.dtype, "--kv-cache-mib", str(args.kv_cache_mib))
    local = ("--local-prefill-tokens", str(args.local_prefill_tokens))
    role_args = {"decode": local} if placement.prefill else {}
    options = UpOptions(
        workers=worker_configs("--model", args.model, *worker_args, **role_args),
        prefill=placement.prefill,
        decode=placement.decode,
        role_cpus=placement.cpus,
        gateway=gateway_config("--routing", "least-load"),
    )
    mesh = Mesh(options)
    try:
        mesh.start()
        target = Target(f"http://127.0.0.1:{mesh.http_port}", args.model)
        event_loop.run(_warm_up(target, w))
        run = event_loop.run(drive(target, w))
    finally:
        mesh.stop()
    return {**asdict(placement), **summarize_run(run)}


async def _warm_up(target: Target, w: PdWorkload) -> None:
    """Short chats at the streams' concurrency, then one long prompt (none is reused later)."""
    await client_loops(target, list(level_prompts(0, w.streams)), w.streams, 8)
    await client_loops(target, [long_prompt("warm-up", 40)], 1, 2)


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"{report['date']} {report['machine']}, {report['dtype']}: {w['streams']} steady streams "
        f"x {w['stream_tokens']} tokens + {w['long_prompts']} long prompts (~"
        f"{w['long_prompt_tokens']} tokens, {w['long_output_tokens']} out) every "
        f"{w['interval_s']} s",
        "| mode | CPUs | steady reqs | TPOT p50 ms | TPOT p90 ms | ITL p50 ms | ITL p90 ms "
        "| ITL p99 ms | TTFT p50 ms | TTFT p90 ms | long TTFT p50 ms | long TTFT p90 ms "
        "| steady tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = (
        "steady_tpot_p50_ms",
        "steady_tpot_p90_ms",
        "steady_itl_p50_ms",
        "steady_itl_p90_ms",
        "steady_itl_p99_ms",
        "steady_ttft_p50_ms",
        "steady_ttft_p90_ms",
        "long_ttft_p50_ms",
        "long_ttft_p90_ms",
    )
    for m in report["modes"]:
        cpus = " ".join(f"{role} {c}" for role, c in m["cpus"].items())
        cells = " | ".join(str(m[k]) for k in keys)
        lines.append(
            f"| {m['mode']} | {cpus} | {m['steady_requests']} | {cells} | {m['steady_tok_s']} |"
        )
    r = report["ratios"]
    if r:
        cells = " | ".join(str(r[k.removesuffix("_ms")]) for k in keys)
        lines.append(f"| disaggregated / colocated | | | {cells} | |")
        lines.append(
            f"p90 TPOT ratio {r['steady_tpot_p90']} (target <= {TPOT_P90_TARGET}: "
            f"{'met' if report['target_met'] else 'missed'})"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--cpus", default=None, help="CPUs of both modes (default: the first 2)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in order")
    parser.add_argument("--streams", type=int, default=4, help="steady decode streams")
    parser.add_argument("--stream-tokens", type=int, default=64, help="max_tokens of each")
    parser.add_argument("--long-prompts", type=int, default=6)
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--long-output-tokens", type=int, default=8)
    parser.add_argument("--interval", type=float, default=8.0, help="s between long prompts")
    parser.add_argument("--first-long", type=float, default=4.0, help="s of streams alone first")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="disaggregated: the decode worker prefills prompts this short itself",
    )
    parser.add_argument("--output", default=None, help="also write the JSON report here")


def run_pd_bench(args: argparse.Namespace) -> int:
    bench = BenchRun()
    w = workload_from(args)
    chosen = placements(checked_cpus(args.cpus or default_cpus()))
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(names) - set(MODES)
    if unknown:
        raise ServeBenchError(f"unknown --modes {sorted(unknown)}; choose from {MODES}")
    rows = {name: run_mode(chosen[name], args, w) for name in names}
    both = len(rows) == 2
    r = ratios(rows["colocated"], rows["disaggregated"]) if both else {}
    tpot_ratio = r.get("steady_tpot_p90")
    report = {
        **bench.header(),
        "model": args.model,
        "dtype": args.dtype,
        "workload": asdict(w),
        "modes": list(rows.values()),
        "ratios": r,
        "target_met": tpot_ratio is not None and tpot_ratio <= TPOT_P90_TARGET,
        **bench.footer(),
    }
    print(markdown(report), flush=True)
    write_report(report, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh_apps.benchmarks.pd", description=__doc__
    )
    add_arguments(parser)
    from kvmesh.log import configure_logging

    configure_logging("pd-bench")
    return run_pd_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
