"""`kvmesh bench agent-api`: what grammars (llguidance, engine/runner/constraints.py) cost and change.

1. Grammar cost: at each concurrency the same chat prompts decode `--max-tokens` tokens with
   and without a JSON-schema grammar (an array of at least 40 short strings: it cannot finish
   within the run, so every step computes a real mask), alternating `--rounds` times in one
   engine; tok/s of each and their ratio (the issue's target: >= 0.9).
2. Time to first token with a cold grammar (a schema never seen: compiled on the request) vs
   the same grammar again (cached), and the compile alone.
3. EAGLE (always drafting 4, one stream) on the JSON prompts held out of its training, with
   and without a json_object grammar: drafts accepted per drafted token and tok/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvmesh_apps.benchmarks.report import BenchRun, write_report

LONG_JSON = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40}


def run_agent_api_bench(args: argparse.Namespace) -> int:
    from kvmesh import LLM
    from kvmesh_apps.benchmarks.spec import workloads

    run = BenchRun()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64)
    levels = [int(c) for c in args.concurrency.split(",")]
    report = {
        **run.header(),
        "model": args.model,
        "dtype": args.dtype,
        "grammar_cost": [_grammar_cost(llm, workloads(c)["chat"], args) for c in levels],
        "ttft": _ttft(llm),
    }
    del llm
    eagle = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=16,
        speculative="eagle",
        speculative_policy="fixed",
    )  # always drafting: acceptance is measured
    report["eagle_json"] = _eagle(eagle, workloads(args.eagle_prompts)["structured"], args)
    report |= run.footer()
    for row in report["grammar_cost"]:
        print(row, flush=True)
    print(report["ttft"], report["eagle_json"], sep="\n")
    write_report(report, args.output)
    return 0


def _params(args: argparse.Namespace, grammar: str | None, eos: bool = False):
    from kvmesh import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=not eos, grammar=grammar
    )


def _timed(llm, prompts: list[str], params) -> tuple[int, float]:
    ids = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    started = time.perf_counter()
    outs = llm.generate_ids(ids, params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - started


def _grammar_cost(llm, prompts: list[str], args: argparse.Namespace) -> dict:
    from kvmesh.agent import grammars

    grammar = grammars.json_schema(LONG_JSON, "bench")
    _timed(llm, prompts[:1], _params(args, grammar))  # compile + warm-up
    spent = {"plain": [0, 0.0], "grammar": [0, 0.0]}
    for _ in range(args.rounds):
        for name, g in (("plain", None), ("grammar", grammar)):
            tokens, seconds = _timed(llm, prompts, _params(args, g))
            spent[name][0] += tokens
            spent[name][1] += seconds
    rate = {name: tokens / seconds for name, (tokens, seconds) in spent.items()}
    return {
        "streams": len(prompts),
        "plain_tok_s": round(rate["plain"], 2),
        "grammar_tok_s": round(rate["grammar"], 2),
        "ratio": round(rate["grammar"] / rate["plain"], 3),
    }


def _ttft(llm) -> dict:
    from kvmesh import SamplingParams
    from kvmesh.agent import grammars

    prompt = [llm.tokenizer.encode_chat([{"role": "user", "content": "A JSON record, please."}])]
    cold, warm, compile_cold, compile_warm = [], [], [], []
    for i in range(5):
        schema = {
            "type": "object",
            "properties": {f"field_{i}_{time.time_ns()}": {"type": "string"}},
        }
        grammar = grammars.json_schema(schema, "bench")
        for times, compiles in ((cold, compile_cold), (warm, compile_warm)):
            started = time.perf_counter()
            llm.engine.constraints.prepare(grammar)
            compiles.append(time.perf_counter() - started)
            if times is cold:  # forget it again: the request below compiles it
                llm.engine.constraints._compiled.clear()
            out = llm.generate_ids(
                prompt, SamplingParams(max_tokens=1, temperature=0.0, grammar=grammar)
            )[0]
            times.append(out.ttft_s)
    ms = lambda values: round(1000 * statistics.median(values), 2)  # noqa: E731
    return {
        "ttft_cold_ms": ms(cold),
        "ttft_cached_ms": ms(warm),
        "compile_cold_ms": ms(compile_cold),
        "compile_cached_ms": ms(compile_warm),
    }


def _eagle(llm, prompts: list[str], args: argparse.Namespace) -> list[dict]:
    from kvmesh.agent import grammars

    stats = llm.engine.speculator.stats
    rows = []
    for name, grammar in (
        ("no grammar", None),
        ("json_object grammar", grammars.json_schema({"type": "object"}, "b")),
    ):
        before = (stats.draft_tokens, stats.accepted_tokens)
        tokens, seconds = 0, 0.0
        for prompt in prompts:  # one stream
            more, spent = _timed(llm, [prompt], _params(args, grammar, eos=True))
            tokens, seconds = tokens + more, seconds + spent
        drafted = stats.draft_tokens - before[0]
        accepted = stats.accepted_tokens - before[1]
        rows.append(
            {
                "method": name,
                "tok_s": round(tokens / seconds, 2),
                "tokens": tokens,
                "drafted": drafted,
                "accepted_per_draft": round(accepted / drafted, 3) if drafted else None,
            }
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eagle-prompts", type=int, default=8)
    parser.add_argument("--output", default=None, help="also write the JSON report here")
