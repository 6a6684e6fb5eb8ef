"""`kvmesh bench step`: where a decode step's time goes, at each concurrency.

One engine (same options as `kvmesh generate`), C requests prefilled, then `--steps` decode
steps timed one by one. Each step is split into the model's compute (`forward` + `logits`, which
includes the per-layer Python of the eager model) and the host work around it: scheduling,
integrity checks, building the attention plan (timed on its own too), sampling (its greedy
argmax kernel timed on its own too), updating the sequences, building outputs; `python_ms` is
the host work less that argmax. The issue's bar is host work below 1 ms per step at 64 streams.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from kvmesh_apps.benchmarks.report import BenchRun, write_report


class _Clock:
    """Wraps methods so each call adds its wall time to `spent[name]`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, owner, method: str, name: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - started

        setattr(owner, method, timed)

    @contextmanager
    def step(self):
        self.spent.clear()
        started = time.perf_counter()
        yield
        self.spent["step"] = time.perf_counter() - started


PARTS = ("step", "model", "plan", "schedule", "update", "integrity", "sample", "argmax")


def measure(engine, concurrency: int, steps: int, prompt_tokens: int) -> dict:
    from kvmesh.engine.core import engine as engine_module
    from kvmesh.engine.core.sampling_params import SamplingParams
    from kvmesh.engine.runner import sampler as sampler_module
    from kvmesh.engine.runner.sample_step import sample_step
    from kvmesh.engine.runner.sampler import greedy_token_ids

    clock = _Clock()
    runner = engine.runner
    clock.wrap(runner.model, "forward", "model")
    clock.wrap(runner.model, "logits", "model")
    if runner.fused is not None:  # decode-only steps' forward (fused_decode.py)
        clock.wrap(runner.fused, "forward", "model")
    clock.wrap(runner.attention, "build_metadata", "plan")
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "update", "update")
    clock.wrap(engine, "_check_integrity", "integrity")
    clock.wrap(engine_module, "sample_step", "sample")
    clock.wrap(sampler_module, "greedy_token_ids", "argmax")  # the Sampler's, inside "sample"
    # no request may finish before the level is timed (the first ones prefilled decode while the
    # others prefill, at most one token per prefill step): every timed step decodes all
    # `concurrency` rows; what is left is aborted
    params = SamplingParams(max_tokens=steps + 2 + concurrency, temperature=0.0, ignore_eos=True)
    start_decoding(engine, f"step-{concurrency}", concurrency, prompt_tokens, params)
    rows = []
    for _ in range(steps):
        assert len(engine.scheduler.running) == concurrency, "a timed step lost a row"
        with clock.step():
            engine.step()
        rows.append(tuple(clock.spent[n] for n in PARTS))
    for seq in list(engine.scheduler.running):
        engine.abort(seq.seq_id)
    while engine.has_unfinished():
        engine.step()
    for owner, name in (
        (runner.model, "forward"),
        (runner.model, "logits"),
        (runner.fused, "forward"),
        (runner.attention, "build_metadata"),
        (engine.scheduler, "schedule"),
        (engine.scheduler, "update"),
        (engine, "_check_integrity"),
    ):
        if owner is not None:
            vars(owner).pop(name, None)
    engine_module.sample_step = sample_step
    sampler_module.greedy_token_ids = greedy_token_ids
    ms = {n: float(np.median([r[i] for r in rows])) * 1e3 for i, n in enumerate(PARTS)}
    # per step, then the median: the model's time swings by more than the host work itself
    host = [r[0] - r[1] for r in rows]
    argmax = [r[PARTS.index("argmax")] for r in rows]
    return {
        "streams": concurrency,
        "host_ms": round(float(np.median(host)) * 1e3, 3),
        # the host work less the argmax kernel's memory pass over the logits: Python and the
        # small library calls it drives (issue 14's "per-step Python")
        "python_ms": round(float(np.median(np.subtract(host, argmax))) * 1e3, 3),
        **{f"{n}_ms": round(v, 3) for n, v in ms.items()},
        "tok_s": round(concurrency / ms["step"] * 1e3, 1),
    }


def start_decoding(engine, prefix: str, streams: int, prompt_tokens: int, params) -> None:
    """`streams` requests of `prompt_tokens` tokens, stepped until every one is prefilled."""
    for i in range(streams):
        prompt = [1 + (i * 7 + j) % 500 for j in range(prompt_tokens)]
        engine.add_request(f"{prefix}-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()


def _amx(engine):
    """The AMX linear kernel on vs off (off: what a CPU without AMX runs)."""
    from kvmesh.engine import kernels

    def switch(on: bool | None) -> None:
        kernels._AMX[:] = [] if on is None else [on]

    return switch


def _fused(engine):
    """The fused decode step (fused_decode.py, one C++ op) vs the eager forward."""
    fused = engine.runner.fused
    if fused is None:
        raise SystemExit("this model does not run fused (see the fused_decode.skipped log)")

    off = contextlib.ExitStack()

    def switch(on: bool | None) -> None:
        off.close()  # back to the engine's own
        if on is False:
            off.enter_context(engine.runner.using(fused=False))

    return switch


def _linear_kernels(engine):
    """Without AMX. On: the GEMV's register tiles up to 64 rows; off: the GEMV up to 8 rows,
    torch above (as before the tiles)."""
    from kvmesh.engine.layers import linear

    served = dict(linear.TILED_ROWS)

    def switch(on: bool | None) -> None:
        rows = {True: dict.fromkeys(served, 64), False: dict.fromkeys(served, 8), None: served}
        linear.TILED_ROWS = rows[on]

    return switch


def _weight_left(engine):
    """fp32: linears of 2-64 rows as weight @ x^T (layers/linear.py) vs torch's x @ W^T."""
    from kvmesh.engine.layers import linear

    served = linear.WEIGHT_LEFT_ROWS

    def switch(on: bool | None) -> None:
        linear.WEIGHT_LEFT_ROWS = (2, 1) if on is False else served

    return switch


def _f32_gemv(engine):
    """fp32: linears of 1-8 rows (1-4 on AVX2) through the GEMV kernel vs torch (weight-left)."""
    from kvmesh.engine.layers import linear

    served = linear.F32_GEMV_ROWS

    def switch(on: bool | None) -> None:
        linear.F32_GEMV_ROWS = {} if on is False else served

    return switch


# name -> (engine -> switch): switch(True / False) turns it on / off, switch(None) restores
TOGGLES = {
    "amx": _amx,
    "fused": _fused,
    "linear-kernels": _linear_kernels,
    "weight-left": _weight_left,
    "f32-gemv": _f32_gemv,
}


def compare(
    engine, toggle: str, concurrency: int, rounds: int, block: int, prompt_tokens: int
) -> dict:
    """Blocks of `block` steps with `toggle` on, then off, `rounds` times over the same
    requests: median ms per step of each (TOGGLES)."""
    from kvmesh.engine.core.sampling_params import SamplingParams

    switch = TOGGLES[toggle](engine)
    steps = 2 * rounds * (block + 1)
    params = SamplingParams(max_tokens=steps + 2 + concurrency, temperature=0.0, ignore_eos=True)
    start_decoding(engine, f"{toggle}-{concurrency}", concurrency, prompt_tokens, params)
    spent: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(rounds):
            for on in (True, False):
                switch(on)
                engine.step()  # the first step after a switch is not timed
                started = time.perf_counter()
                for _ in range(block):
                    engine.step()
                spent[on].append((time.perf_counter() - started) / block)
    finally:
        switch(None)
    for seq in list(engine.scheduler.running):
        engine.abort(seq.seq_id)
    while engine.has_unfinished():
        engine.step()
    on, off = (float(np.median(spent[a])) * 1e3 for a in (True, False))
    return {
        "streams": concurrency,
        "compare": toggle,
        "on_ms": round(on, 3),
        "off_ms": round(off, 3),
        "speedup": round(off / on, 3),
    }


def run_step_bench(args: argparse.Namespace) -> int:
    from kvmesh.config import EngineConfig
    from kvmesh.engine.core.engine import Engine

    run = BenchRun()
    engine = Engine(
        EngineConfig.of(
            model=args.model,
            dtype=args.dtype,
            weights=args.weights,
            kv_dtype=args.kv_dtype,
            max_num_seqs=256,
            attention_backend=args.attention_backend,
        )
    )
    levels = [int(c) for c in args.concurrency.split(",")]
    results = []
    for c in levels:
        if args.compare:
            results.append(compare(engine, args.compare, c, 6, 4, args.prompt_tokens))
        else:
            results.append(measure(engine, c, args.steps, args.prompt_tokens))
        print(results[-1], flush=True)
    report = {
        **run.header(),
        "model": args.model,
        "dtype": args.dtype,
        "weights": args.weights,
        "kv_dtype": args.kv_dtype,
        "attention_backend": args.attention_backend,
        "levels": results,
        **run.footer(),
    }
    write_report(report, args.output)
    return 0


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine options of the decode-step benches (this one and `bench compiled`)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int4"])
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp8_e4m3"])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output", default=None, help="also write the JSON report here")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    engine_arguments(parser)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per level")
    parser.add_argument(
        "--compare",
        choices=sorted(TOGGLES),
        default=None,
        help="time blocks of steps with amx (the AMX linear kernel), fused (the fused decode "
        "step) or linear-kernels (bf16 linears of 9-64 rows through the kernels instead of "
        "torch) or weight-left (fp32 linears of 2-64 rows as weight @ x^T) or f32-gemv (fp32 "
        "linears of 1-8 rows through the GEMV kernel) on vs off instead",
    )
