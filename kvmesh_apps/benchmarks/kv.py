"""`kvmesh bench kv`: FP8 (e4m3) vs BF16 KV at one memory budget, integrity-check cost, quality.

One process, one run: first the model's KV spec (bytes per token and layer in FP32 / BF16 /
FP8, capacity at the budget; `--spec-only` stops there), then three tables:
1. throughput: a `--dtype` model with BF16 KV and with FP8 KV in the same byte budget (default:
   what `BF16_REQUESTS` requests' whole context takes in BF16 pages, so FP8 holds ~31). Per level,
   C distinct chat prompts of ~`--prompt-tokens` tokens are submitted at once, `--max-tokens`
   greedy tokens each (EOS ignored), on both engines at once, stepped in lockstep (one step of
   each in turn: benchmarks/lockstep.py); tok/s = generated tokens / seconds of that engine's own
   steps, prefill included. Each engine is built once (prefix cache reset per run).
2. integrity: one engine with `kv_integrity` toggled off/on/off/on per level, best of 2 each;
   plus the time measured inside `PageTags.mismatched` as a share of the run (noise-free cost).
3. quality under an fp32 model: greedy tokens until the first divergence from FP32 KV, and
   teacher-forced perplexity on a public-domain text, for FP32, BF16 and FP8 KV.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.config.knobs import with_knobs
from kvmesh_apps.benchmarks.kv_quality import QUESTIONS, bench_quality, markdown
from kvmesh_apps.benchmarks.kv_runs import Run, lockstep_runs, timed_run
from kvmesh_apps.benchmarks.report import BenchRun, write_report

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "public_domain.txt"
BF16_REQUESTS = 16  # the default budget holds this many requests' full context in BF16 pages
REPORTED_ARGS = ("model", "dtype", "integrity_dtype", "prompt_tokens", "max_tokens", "repeats")


@dataclass(frozen=True)
class ThroughputRow:
    concurrency: int
    kv_dtype: str
    capacity_tokens: int
    kv_bytes: int
    max_running: int
    preemptions: int
    tok_s: float
    fp8_over_bf16: float | None


@dataclass(frozen=True)
class IntegrityRow:
    concurrency: int
    off_tok_s: float
    on_tok_s: float
    on_over_off: float
    check_us_per_step: float
    check_fraction: float  # time inside the check / wall time of the integrity-on runs


def sized_prompts(tokenizer, n: int, tokens: int, text: str) -> list[list[int]]:
    """n chat prompts of ~`tokens` tokens, distinct from their first page on (a numbered system
    message), each asking to summarize a window of the text starting at a different offset."""
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = []
    for i in range(n):
        source = (text_ids * (2 + tokens // len(text_ids)))[(i * 37) % len(text_ids) :]
        system = {"role": "system", "content": f"You are assistant number {i}."}
        ids, take = [], tokens
        for _ in range(5):  # tokenization at the excerpt's edges shifts the count a little
            excerpt = tokenizer.decode(source[: max(take, 1)])
            user = {"role": "user", "content": f"Summarize this excerpt:\n{excerpt}"}
            ids = tokenizer.encode_chat([system, user])
            if len(ids) == tokens:
                break
            take += tokens - len(ids)
        prompts.append(ids)
    return prompts


def budget_bytes(args: argparse.Namespace) -> tuple[int, str]:
    """The KV budget: --kv-cache-memory, or BF16_REQUESTS full contexts in BF16 pages."""
    from kvmesh.config.engine import parse_size
    from kvmesh.engine.config import spec_for_model
    from kvmesh.engine.loader import read_config, resolve_model

    if args.kv_cache_memory:
        return parse_size(args.kv_cache_memory), f"--kv-cache-memory {args.kv_cache_memory}"
    spec = spec_for_model(read_config(resolve_model(args.model)), args.page_size, "bf16")
    pages = -(-(args.prompt_tokens + args.max_tokens) // args.page_size)
    budget = BF16_REQUESTS * pages * spec.page_bytes
    return budget, f"{BF16_REQUESTS} requests x {pages} pages x {spec.page_bytes} B (BF16 page)"


def bench_throughput(args, text: str, levels: list[int], budget: int) -> list[ThroughputRow]:
    from kvmesh import LLM

    llms = {
        kv: LLM(
            model=args.model,
            dtype=args.dtype,
            kv_dtype=kv,
            kv_cache_bytes=budget,
            page_size=args.page_size,
            max_num_seqs=max(levels),
        )
        for kv in ("bf16", "fp8_e4m3")
    }
    for llm in llms.values():
        timed_run(llm, sized_prompts(llm.tokenizer, 2, 32, text), 4)  # warm-up
    rows: list[ThroughputRow] = []
    for c in levels:
        prompts = sized_prompts(llms["bf16"].tokenizer, c, args.prompt_tokens, text)
        runs = lockstep_runs(llms, prompts, args.max_tokens)
        base = runs["bf16"].tok_s
        for kv, llm in llms.items():
            run, cache = runs[kv], llm.engine.kv_cache
            rows.append(
                ThroughputRow(
                    c,
                    kv,
                    cache.capacity_tokens,
                    cache.nbytes,
                    run.max_running,
                    run.preemptions,
                    round(run.tok_s, 1),
                    round(run.tok_s / base, 2) if kv != "bf16" else None,
                )
            )
            print(json.dumps(asdict(rows[-1])), flush=True)
    return rows


def bench_integrity(args, text: str, levels: list[int]):
    """One engine, its `kv_integrity` flag toggled between runs (read each step), so on and off
    share weights, pool and allocator state. Returns the rows and the engine (flag on), which is
    the FP32 KV reference of the quality table."""
    from kvmesh import LLM

    llm = LLM(
        model=args.model,
        dtype=args.integrity_dtype,
        page_size=args.page_size,
        max_num_seqs=max(levels),
        kv_integrity=True,
    )
    config = llm.engine.config
    timed_run(llm, sized_prompts(llm.tokenizer, 2, 32, text), 4)  # warm-up
    rows: list[IntegrityRow] = []
    for c in levels:
        prompts = sized_prompts(llm.tokenizer, c, args.prompt_tokens, text)
        runs: dict[bool, list[Run]] = {False: [], True: []}
        for _ in range(args.repeats):
            for on in (False, True):
                llm.engine.config = with_knobs(config, kv_integrity=on)
                runs[on].append(timed_run(llm, prompts, args.max_tokens))
        llm.engine.config = config
        assert all(r.check_calls == 0 for r in runs[False])
        off, on = (max(r.tok_s for r in runs[k]) for k in (False, True))
        check = sum(r.check_seconds for r in runs[True])
        calls = sum(r.check_calls for r in runs[True])
        wall = sum(r.seconds for r in runs[True])
        rows.append(
            IntegrityRow(
                c,
                round(off, 1),
                round(on, 1),
                round(on / off, 3),
                round(1e6 * check / max(calls, 1), 1),
                round(check / wall, 5),
            )
        )
        print(json.dumps(asdict(rows[-1])), flush=True)
    return rows, llm


@contextlib.contextmanager
def weights_loaded_once() -> Iterator[None]:
    """Dequantize the model file once per run (~5 s a load here): every engine the bench builds
    gets the same (config, weights), read-only; a model casts or fuses them into its own."""
    import kvmesh.engine.core.engine as engine_module

    load = engine_module.load_weights
    loaded: dict = {}

    def load_once(source, int4=False):
        if (source, int4) not in loaded:
            config, weights = load(source, int4)
            loaded[source, int4] = config, dict(weights)  # read (and converted) once
        config, weights = loaded[source, int4]
        return config, dict(weights)

    engine_module.load_weights = load_once
    try:
        yield
    finally:
        engine_module.load_weights = load


def run_kv_bench(args: argparse.Namespace) -> int:
    run = BenchRun()
    if args.quick:
        args.concurrency, args.integrity_concurrency = "1,2", "1,2"
        args.prompt_tokens, args.max_tokens = 64, 8
        args.quality_prompts, args.quality_tokens, args.text_tokens = 2, 8, 128
    from kvmesh_apps.benchmarks.kv_spec import spec_markdown, spec_rows

    text = Path(args.text).read_text()
    budget, how = budget_bytes(args)
    print(f"KV budget: {budget} bytes ({budget / 2**20:.2f} MiB) = {how}", flush=True)
    spec = spec_rows(args.model, args.page_size, budget)
    print(spec_markdown(args.model, spec, budget), flush=True)
    if args.spec_only:
        write_report(
            {
                **run.header(),
                "model": args.model,
                "kv_budget_bytes": budget,
                "spec": [asdict(r) for r in spec],
            },
            args.output,
        )
        return 0
    with weights_loaded_once():
        levels = [int(c) for c in args.concurrency.split(",")]
        throughput = bench_throughput(args, text, levels, budget)
        gc.collect()
        levels = [int(c) for c in args.integrity_concurrency.split(",")]
        integrity, reference = bench_integrity(args, text, levels)
        quality, text_tokens = bench_quality(args, text, reference)
    report = {
        **run.header(),
        **{k: getattr(args, k) for k in REPORTED_ARGS},
        "kv_budget_bytes": budget,
        "kv_budget": how,
        "text_tokens": text_tokens,
        "quality_tokens": args.quality_tokens,
        **run.footer(),
        "spec": [asdict(r) for r in spec],
        "throughput": [asdict(r) for r in throughput],
        "integrity": [asdict(r) for r in integrity],
        "quality": [asdict(r) for r in quality],
    }
    print(markdown(report))
    write_report(report, args.output)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", help="model dtype of the throughput table")
    parser.add_argument("--integrity-dtype", default="fp32", help="model dtype, tables 2 and 3")
    parser.add_argument("--concurrency", default="1,8,16,32,64", help="throughput levels")
    parser.add_argument("--integrity-concurrency", default="1,2,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--page-size", type=int, default=16)
    budget = f"throughput KV budget, e.g. 160MiB (default: {BF16_REQUESTS} contexts in BF16)"
    parser.add_argument("--kv-cache-memory", default=None, help=budget)
    parser.add_argument("--repeats", type=int, default=2, help="integrity runs per mode")
    parser.add_argument("--quality-prompts", type=int, default=len(QUESTIONS))
    parser.add_argument("--quality-tokens", type=int, default=64)
    parser.add_argument("--text", default=str(TEXT), help="text for perplexity")
    parser.add_argument("--text-tokens", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument(
        "--spec-only",
        action="store_true",
        help="only the KV spec table (page layout and capacity; no model run)",
    )
    parser.add_argument("--output", default=None, help="also write the JSON report here")


def main(argv: list[str] | None = None) -> int:
    from kvmesh.log import configure_logging

    parser = argparse.ArgumentParser(
        prog="python -m kvmesh_apps.benchmarks.kv", description=__doc__
    )
    add_arguments(parser)
    configure_logging("kv-bench")
    return run_kv_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
