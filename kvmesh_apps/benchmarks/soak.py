"""`kvmesh bench soak`: many streams for a long time (64 for 30 minutes by default). Counts
errors, and samples every process's resident memory and open file descriptors and every
worker's KV pages; after the warm-up it fits a line to each series and reports the slope (per
minute): a leak shows as a slope that is not ~0."""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvmesh_apps.benchmarks.chaos import Tally, expected_texts, load_loop
from kvmesh_apps.benchmarks.report import BenchRun, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument(
        "--warmup-minutes",
        type=float,
        default=3.0,
        help="samples before this are left out of the slopes",
    )
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output", default=None, help="also write the JSON results here")


def run_soak_bench(args: argparse.Namespace) -> int:
    from kvmesh.mesh.launcher import Mesh, UpOptions
    from kvmesh.mesh.up_config import worker_configs

    expected = expected_texts(args)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    run = BenchRun()
    mesh = Mesh(
        UpOptions(
            workers=worker_configs(
                "--model", args.model, "--kv-cache-mib", "128", "--max-num-seqs", "64"
            ),
            prefill=1,
            decode=1,
            kvstore="builtin",
        )
    )
    samples: list[dict] = []
    try:
        mesh.start()
        tally, stop = Tally(), threading.Event()
        with ThreadPoolExecutor(args.streams) as pool:
            loops = [
                pool.submit(load_loop, mesh.url, args, expected, tally, stop, k)
                for k in range(args.streams)
            ]
            begun = time.monotonic()
            while (elapsed := time.monotonic() - begun) < args.minutes * 60:
                samples.append({"t_min": elapsed / 60, **_sample(mesh)})
                print(samples[-1], flush=True)
                time.sleep(args.sample_s)
            stop.set()
            for loop in loops:
                loop.result()
    finally:
        mesh.stop()
    steady = [s for s in samples if s["t_min"] >= args.warmup_minutes] or samples
    series = sorted({key for s in steady for key in s} - {"t_min"})
    slopes = {key: _slope([(s["t_min"], s[key]) for s in steady if key in s]) for key in series}
    report = {
        **run.header(),
        "streams": args.streams,
        "minutes": args.minutes,
        "outcomes": dict(tally.outcomes),
        "completed": len(tally.completed_at),
        "slopes_per_minute": slopes,
        "first": steady[0] if steady else None,
        "last": steady[-1] if steady else None,
        "samples": samples,
    } | run.footer()
    print({k: report[k] for k in ("outcomes", "completed", "slopes_per_minute")})
    write_report(report, args.output)
    return 0 if set(tally.outcomes) == {"exact"} else 1


def _sample(mesh) -> dict[str, float]:
    """RSS (MiB) and open fds of every process; KV pages held by every worker."""
    from kvmesh.mesh.status import _collect

    out: dict[str, float] = {}
    for name, pid in mesh.pids().items():
        rss = _rss_mib(pid)
        if rss is not None:
            out[f"{name}.rss_mib"] = rss
            out[f"{name}.fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    for worker in asyncio.run(_collect(mesh.etcd.endpoint, "default")):
        out[f"{worker['id']}.pages"] = int((worker["load"] or {}).get("kvPagesUsed", 0))
    return out


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 with fewer than two points)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0
    return round(sum((x - mean_x) * (y - mean_y) for x, y in points) / var, 4)
