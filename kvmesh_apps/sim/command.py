"""`kvmesh sim run|claims|sweep|calibrate|check`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvmesh.errors import InvalidRequestError
from kvmesh.routing import ROUTINGS
from kvmesh_apps.sim.fleet import Fleet, simulate
from kvmesh_apps.sim.presets import Preset, load_preset, preset_names
from kvmesh_apps.sim.report import Summary, summarize, table
from kvmesh_apps.sim.workload import AgentWorkload, ChatWorkload

# The claims' scenario: peak load on 8 nodes of 8 H100s (one worker each) serving a
# Kimi-K2-class model to agents of 4 apps (8k-token system prompts, 1.5k-token tool results).
PEAK = AgentWorkload(
    sessions=200,
    turns=10,
    system_tokens=8000,
    systems=4,
    message_tokens=1500,
    reply_tokens=200,
    think_s=2.0,
    start_s=60.0,
)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--prefill", type=int, default=4, help="prefill workers (0: colocated)")
    p.add_argument("--decode", type=int, default=4, help="decode (or colocated) workers")
    p.add_argument(
        "--routing",
        default=",".join(ROUTINGS),
        help=f"comma-separated, side by side: {', '.join(ROUTINGS)}",
    )


def add_claims_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, preset="h100-kimi-k2")
    p.add_argument("--workers", type=int, default=8, help="nodes: colocated N vs N/2P + N/2D")


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, sessions=8, turns=4)
    p.add_argument(
        "--workers",
        default="1,10,100,1000",
        help="fleet sizes (1: one colocated worker; else half prefill, half decode)",
    )
    p.add_argument("--routing", default="cache-aware,least-load")


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-mib", type=int, default=128)
    p.add_argument("--output", required=True, help="the fitted preset (JSON) to write")


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-mib", type=int, default=128)
    p.add_argument("--output", default=None, help="also write the JSON report here")


def _common(
    p: argparse.ArgumentParser, preset: str = "h100-kimi-k2", sessions: int = 200, turns: int = 10
) -> None:
    p.add_argument(
        "--preset",
        default=preset,
        help=f"cost preset: {', '.join(preset_names())}, or a calibrated JSON file",
    )
    p.add_argument("--kv-pages", type=int, default=None, help="pages per worker (default: preset)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=None,
        help="decode workers compute prompts up to this long themselves (default 0)",
    )
    p.add_argument("--workload", default="agent", choices=["agent", "chat", "burst"])
    p.add_argument("--sessions", type=int, default=sessions, help="agent sessions")
    p.add_argument("--turns", type=int, default=turns)
    p.add_argument("--system-tokens", type=int, default=PEAK.system_tokens)
    p.add_argument("--systems", type=int, default=PEAK.systems, help="distinct system prompts")
    p.add_argument("--message-tokens", type=int, default=PEAK.message_tokens)
    p.add_argument("--reply-tokens", type=int, default=PEAK.reply_tokens)
    p.add_argument("--think-s", type=float, default=PEAK.think_s)
    p.add_argument("--start-s", type=float, default=PEAK.start_s)
    p.add_argument("--no-affinity", action="store_true", help="send no x-session-affinity")
    p.add_argument("--rate", type=float, default=20.0, help="chat / burst: requests per second")
    p.add_argument("--duration-s", type=float, default=60.0, help="chat / burst")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the JSON results here")


def _workload(args: argparse.Namespace, scale: float = 1.0):
    if args.workload == "agent":
        return AgentWorkload(
            max(1, round(args.sessions * scale)),
            args.turns,
            args.system_tokens,
            args.systems,
            args.message_tokens,
            args.reply_tokens,
            args.think_s,
            args.start_s,
            not args.no_affinity,
            seed=args.seed,
        )
    burst = 10.0 if args.workload == "burst" else 0.0
    return ChatWorkload(
        args.rate * scale,
        args.duration_s,
        args.system_tokens,
        max(1, args.systems),
        args.message_tokens,
        args.reply_tokens,
        burst,
        seed=args.seed,
    )


def _preset(args: argparse.Namespace) -> Preset:
    for routing in getattr(args, "routing", "").split(","):
        if routing and routing not in ROUTINGS:
            raise InvalidRequestError(f"--routing: {routing!r} is not one of {', '.join(ROUTINGS)}")
    return load_preset(args.preset, args.kv_pages, args.max_num_seqs, args.local_prefill_tokens)


def _side_by_side(fleets: list[Fleet], preset: Preset, workload) -> list[tuple[Summary, float]]:
    out = []
    for fleet in fleets:
        began = time.perf_counter()
        summary = summarize(simulate(fleet, preset, workload.build()))
        out.append((summary, time.perf_counter() - began))
        print(
            f"  {fleet.label}: {summary.requests} requests, simulated {summary.sim_s:,.0f} s "
            f"in {out[-1][1]:,.1f} s",
            flush=True,
        )
    return out


def _report(args: argparse.Namespace, title: str, rows, extra: dict | None = None) -> None:
    print(f"\n{title}\n")
    print(table([s for s, _ in rows]))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "args": vars(args),
                    "runs": [{**s.as_dict(), "wall_s": round(w, 2)} for s, w in rows],
                    **(extra or {}),
                },
                indent=1,
                default=str,
            )
            + "\n"
        )


def run_sim(args: argparse.Namespace) -> int:
    from kvmesh.log import configure_logging

    configure_logging("sim", "WARNING")  # the router logs every decision at info
    return {
        "run": _run,
        "claims": _claims,
        "sweep": _sweep,
        "calibrate": _calibrate,
        "check": _check,
    }[args.sim](args)


def _run(args: argparse.Namespace) -> int:
    preset, workload = _preset(args), _workload(args)
    fleets = [Fleet(args.prefill, args.decode, r) for r in args.routing.split(",")]
    _report(args, f"{args.workload} on {preset.cost.name}", _side_by_side(fleets, preset, workload))
    return 0


def _claims(args: argparse.Namespace) -> int:
    """The seeds' two fleet claims, on one workload at peak load."""
    if args.workers < 2:
        raise InvalidRequestError("--workers: at least 2 (colocated N vs N/2 prefill + N/2 decode)")
    preset, workload, n = _preset(args), _workload(args), args.workers
    fleets = [
        Fleet(0, n, "round-robin"),
        Fleet(0, n, "least-load"),
        Fleet(0, n, "cache-aware"),
        Fleet(n // 2, n - n // 2, "least-load"),
        Fleet(n // 2, n - n // 2, "cache-aware"),
    ]
    rows = _side_by_side(fleets, preset, workload)
    by = {s.label: s for s, _ in rows}
    colo, disagg = f"{n} colocated", f"{n // 2}P+{n - n // 2}D"
    claims = {
        "hit_ratio_least_load_colocated": by[f"{colo}, least-load"].hit_ratio,
        "hit_ratio_cache_aware_colocated": by[f"{colo}, cache-aware"].hit_ratio,
        "hit_ratio_least_load_disaggregated": by[f"{disagg}, least-load"].hit_ratio,
        "hit_ratio_cache_aware_disaggregated": by[f"{disagg}, cache-aware"].hit_ratio,
        "tpot_p90_colocated_round_robin_over_disaggregated_least_load": by[
            f"{colo}, round-robin"
        ].tpot_p90_s
        / by[f"{disagg}, least-load"].tpot_p90_s,
        "tpot_p90_colocated_round_robin_over_disaggregated_cache_aware": by[
            f"{colo}, round-robin"
        ].tpot_p90_s
        / by[f"{disagg}, cache-aware"].tpot_p90_s,
    }
    _report(args, f"claims on {preset.cost.name}", rows, {"claims": claims})
    for name, value in claims.items():
        print(f"{name}: {value:.3f}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """The same per-worker load from 1 to N workers: sessions scale with the fleet."""
    preset, rows = _preset(args), []
    for n in (int(x) for x in args.workers.split(",")):
        workload = _workload(args, scale=n)
        for routing in args.routing.split(","):
            fleet = Fleet(0, 1, routing) if n == 1 else Fleet(n // 2, n - n // 2, routing)
            rows += _side_by_side([fleet], preset, workload)
    _report(args, f"sweep on {preset.cost.name} ({args.sessions} sessions a worker)", rows)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import asyncio

    from kvmesh_apps.sim.calibrate import MeshSetup, calibrate_on, mesh_for, preset_json
    from kvmesh_apps.sim.check import machine

    setup = MeshSetup(model=args.model, kv_cache_mib=args.kv_cache_mib)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with mesh_for(setup) as mesh:
        source = f"kvmesh sim calibrate, {started}, {machine()}"
        preset = asyncio.run(calibrate_on(mesh, setup, source))
    Path(args.output).write_text(json.dumps(preset_json(preset), indent=1) + "\n")
    print(json.dumps(asdict(preset.cost), indent=1))
    return 0


def _check(args: argparse.Namespace) -> int:
    from kvmesh_apps.sim.calibrate import MeshSetup
    from kvmesh_apps.sim.check import TIMING_BOUND, run_check

    result = run_check(MeshSetup(model=args.model, kv_cache_mib=args.kv_cache_mib))
    for side in ("mesh", "sim"):
        f = result[side]
        print(
            f"{side}: hit ratio {f['hit_ratio']:.1%}, mean TTFT {f['ttft_mean_s'] * 1000:,.0f} ms, "
            f"mean TPOT {f['tpot_mean_s'] * 1000:,.1f} ms ({f['requests']} requests)"
        )
    print(
        f"hit ratio {result['hit_ratio_points']:.1f} points apart, TTFT {result['ttft_rel']:.0%}, "
        f"TPOT {result['tpot_rel']:.0%}"
    )
    real, sim = result["mesh_routing"], result["sim_routing"]
    print(
        f"1 prefill + 2 decode: hit ratio mesh {real['hit_ratio']:.1%}, sim {sim['hit_ratio']:.1%} "
        f"({result['routing_hit_ratio_points']:.1f} points apart)"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    if max(result["ttft_rel"], result["tpot_rel"]) > TIMING_BOUND:
        print(f"TTFT or TPOT off by more than {TIMING_BOUND:.0%}", file=sys.stderr)
        return 1
    return 0
