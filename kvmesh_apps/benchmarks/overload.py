"""`kvmesh bench overload`: a mesh whose workers each hold at most --capacity requests, driven
first at its capacity, then by 4x as many clients at once. Past capacity the gateway must answer
429 with Retry-After at once (no queue growing without end), the requests it accepts must keep
their time per output token (the bar: within 2x of the run at capacity), and memory must stay
put. Reports TPOT percentiles of both phases, the 429 count and every process's RSS."""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvmesh_apps.benchmarks.report import BenchRun, write_report
from kvmesh_apps.benchmarks.soak import _rss_mib


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--capacity", type=int, default=8, help="--max-queued-requests per worker")
    parser.add_argument("--factor", type=int, default=4, help="clients at once = factor x capacity")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--output", default=None, help="also write the JSON results here")


def run_overload_bench(args: argparse.Namespace) -> int:
    from kvmesh.mesh.launcher import Mesh, UpOptions
    from kvmesh.mesh.up_config import worker_configs

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    run = BenchRun()
    cap = str(args.capacity)
    mesh = Mesh(
        UpOptions(
            workers=worker_configs(
                "--model", args.model, "--max-queued-requests", cap, "--max-num-seqs", cap
            ),
            prefill=1,
            decode=1,
            kvstore="none",
        )
    )
    phases = {}
    try:
        mesh.start()
        rss_before = _rss(mesh)
        for name, clients in (
            ("at_capacity", args.capacity),
            ("overloaded", args.capacity * args.factor),
        ):
            phases[name] = _phase(mesh.url, args, clients)
            print(name, {k: v for k, v in phases[name].items() if k != "tpot_s"}, flush=True)
        rss_after = _rss(mesh)
    finally:
        mesh.stop()
    base, over = phases["at_capacity"]["tpot_p90_s"], phases["overloaded"]["tpot_p90_s"]
    report = {
        **run.header(),
        "capacity": args.capacity,
        "factor": args.factor,
        "phases": phases,
        "tpot_p90_ratio": round(over / base, 3) if base else None,
        "rss_mib_before": rss_before,
        "rss_mib_after": rss_after,
    } | run.footer()
    print({k: report[k] for k in ("tpot_p90_ratio", "rss_mib_before", "rss_mib_after")})
    write_report(report, args.output)
    return 0


def _phase(url: str, args: argparse.Namespace, clients: int) -> dict:
    import httpx

    lock, tpots, statuses, retry_after = threading.Lock(), [], {}, set()
    end = time.monotonic() + args.seconds
    body = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while time.monotonic() < end:
                with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                    chunks = [time.monotonic() for line in reply.iter_lines() if line]
                with lock:
                    statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
                    if reply.status_code == 429:
                        retry_after.add(reply.headers.get("retry-after"))
                    elif reply.status_code == 200 and len(chunks) > 3:
                        tpots.append((chunks[-2] - chunks[1]) / max(len(chunks) - 4, 1))
                if reply.status_code == 429:
                    time.sleep(float(reply.headers.get("retry-after", "1")))

    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    tpots.sort()
    return {
        "clients": clients,
        "statuses": statuses,
        "retry_after": sorted(map(str, retry_after)),
        "completed": len(tpots),
        "tpot_p50_s": round(statistics.median(tpots), 4) if tpots else None,
        "tpot_p90_s": round(tpots[int(0.9 * (len(tpots) - 1))], 4) if tpots else None,
        "tpot_s": [round(t, 4) for t in tpots],
    }


def _rss(mesh) -> dict[str, float | None]:
    return {name: _rss_mib(pid) for name, pid in mesh.pids().items()}
