"""`kvmesh bench compiled`: the compiled decode step against the eager one, side by side.

One engine with `decode_step="compiled"`; once every bucket is compiled, each concurrency level
prefills C requests, then alternates blocks of decode steps with the compiled graphs on and off
(the same requests, the same pages), so a noisy neighbour hits both alike. Reports each bucket's
compile seconds (a second run shows the on-disk cache) and ms per step, eager / compiled.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvmesh_apps.benchmarks.report import BenchRun, write_report
from kvmesh_apps.benchmarks.step import engine_arguments, start_decoding


def _ready(engine, timeout_s: float = 3600.0):
    compiled = engine.runner.compiled
    deadline = time.monotonic() + timeout_s
    while compiled.failed is None and len(compiled.ready) < len(compiled.buckets):
        if time.monotonic() > deadline:
            raise TimeoutError("the buckets did not compile in time")
        time.sleep(0.5)
    if compiled.failed is not None:
        raise RuntimeError(f"compile failed: {compiled.failed}")
    return compiled


def _level(engine, compiled, streams: int, rounds: int, block: int, prompt_tokens: int) -> dict:
    from kvmesh.engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2 * rounds * block + 8, temperature=0.0, ignore_eos=True)
    start_decoding(engine, f"compiled-{streams}", streams, prompt_tokens, params)
    ms: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for mode in ("eager", "compiled"):
            with engine.runner.using(compiled=mode == "compiled"):
                started = time.perf_counter()
                for _ in range(block):
                    engine.step()
                ms[mode].append((time.perf_counter() - started) / block * 1e3)
    while engine.has_unfinished():
        engine.step()
    eager, graph = statistics.median(ms["eager"]), statistics.median(ms["compiled"])
    return {
        "streams": streams,
        "eager_ms": round(eager, 3),
        "compiled_ms": round(graph, 3),
        "speedup": round(eager / graph, 3),
        "rounds": rounds,
        "block": block,
    }


def run_compiled_bench(args: argparse.Namespace) -> int:
    from kvmesh.config import EngineConfig
    from kvmesh.engine.core.engine import Engine

    run = BenchRun()
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = Engine(
        EngineConfig.of(
            model=args.model,
            dtype=args.dtype,
            weights=args.weights,
            kv_dtype=args.kv_dtype,
            max_num_seqs=max(levels),
            decode_step="compiled",
        )
    )
    started = time.perf_counter()
    compiled = _ready(engine)
    print({"compile_s": round(time.perf_counter() - started, 1), "buckets": compiled.seconds})
    results = []
    for streams in levels:
        results.append(
            _level(engine, compiled, streams, args.rounds, args.block, args.prompt_tokens)
        )
        print(results[-1], flush=True)
    report = {
        **run.header(),
        "model": args.model,
        "dtype": args.dtype,
        "weights": args.weights,
        "kv_dtype": args.kv_dtype,
        "compile_s": compiled.seconds,
        "levels": results,
        **run.footer(),
    }
    write_report(report, args.output)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    engine_arguments(parser)
    parser.add_argument("--rounds", type=int, default=6, help="eager / compiled block pairs")
    parser.add_argument("--block", type=int, default=8, help="decode steps per block")
