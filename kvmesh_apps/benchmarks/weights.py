"""`kvmesh bench weights`: INT4 vs bf16 vs fp32 weights in one run.

1. memory and speed, per weight configuration: bytes of the weights the model holds, load time,
   and decode tokens/s at each concurrency -- C chat prompts submitted at once, `--max-tokens`
   greedy tokens each (EOS ignored); the clock starts once every request has its first token
   (prefill done), so the figure is decode alone; and prefill tokens/s of one long prompt
   (`--prefill-tokens`, an agent's system prompt and tools). Configurations alternate.
2. quality (weights_quality.py): perplexity of a public-domain text's second half and greedy
   agreement with fp32, for INT4 decode alone (bf16 prefill) and INT4 prefill + decode.

Configurations: fp32, bf16 (dense), and INT4 with bf16 activations: `int4` (decoder linears
INT4 -- the default model's Q4_1 blocks as they are -- embedding / LM head bf16), `int4+emb`
(the tied embedding / LM head INT4 too) and `int4-g64+emb` (everything regrouped to 64).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh_apps.benchmarks.kv import TEXT
from kvmesh_apps.benchmarks.offline import chat_prompts
from kvmesh_apps.benchmarks.report import BenchRun, write_report
from kvmesh_apps.benchmarks.weights_quality import bench_quality

CONFIGS: dict[str, dict] = {
    "fp32": {"dtype": "fp32"},
    "bf16": {"dtype": "bf16"},
    "int4": {"dtype": "bf16", "weights": "int4"},
    "int4+emb": {"dtype": "bf16", "weights": "int4", "int4_embeddings": True},
    "int4-g64+emb": {
        "dtype": "bf16",
        "weights": "int4",
        "int4_group_size": 64,
        "int4_embeddings": True,
    },
    # not in the default run: INT4 with fp32 activations (BF16 KV, to pair with bf16 prefill)
    "int4-fp32act": {"dtype": "fp32", "weights": "int4", "kv_dtype": "bf16"},
}
DEFAULT_CONFIGS = ("fp32", "bf16", "int4", "int4+emb", "int4-g64+emb")


@dataclass(frozen=True)
class MemoryRow:
    config: str
    weight_bytes: int
    vs_bf16: float
    load_s: float


@dataclass(frozen=True)
class SpeedRow:
    config: str
    concurrency: int
    decode_tok_s: float
    vs_bf16: float


def decode_tok_s(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens generated after every request has its first one, over the time that took."""
    from kvmesh import SamplingParams

    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w-{i}", prompt, params)
    counts: dict[str, int] = {}
    start = tokens = None
    while engine.has_unfinished():
        for step in engine.step():
            if step.error is not None:
                raise RuntimeError(f"{step.request_id}: {step.error}")
            counts[step.request_id] = counts.get(step.request_id, 0) + len(step.new_token_ids)
            if tokens is not None:
                tokens += len(step.new_token_ids)
        if start is None and len(counts) == len(prompts):
            start, tokens = time.perf_counter(), 0
    return tokens / (time.perf_counter() - start)


def prefill_tok_s(engine, prompt: list[int]) -> float:
    """Prompt tokens per second of one prefill from an empty cache (a long agent prompt)."""
    from kvmesh import SamplingParams

    engine.block_manager.reset_prefix_cache()
    engine.add_request("p-0", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def bench_prefill(args, engines: dict, tokenizer) -> list[SpeedRow]:
    """SpeedRows whose `concurrency` is 0 and `decode_tok_s` is prefill tok/s, interleaved."""
    if not args.prefill_tokens:
        return []
    words = Path(args.text).read_text().split()
    prompt = tokenizer.encode(" ".join(words * 8))[: args.prefill_tokens]
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            best[name] = max(best.get(name, 0.0), prefill_tok_s(engine, prompt))
    base = best.get("bf16", next(iter(best.values())))
    rows = [SpeedRow(n, 0, round(v, 1), round(v / base, 2)) for n, v in best.items()]
    for row in rows:
        print(json.dumps({**asdict(row), "prefill_tokens": len(prompt)}), flush=True)
    return rows


def load_engines(args) -> tuple[dict, list[MemoryRow]]:
    from kvmesh.config import EngineConfig
    from kvmesh.engine.core.engine import Engine

    engines, rows = {}, []
    for name in args.configs.split(","):
        start = time.perf_counter()
        engines[name] = Engine(
            EngineConfig.of(
                model=args.model,
                kv_cache_bytes=args.kv_cache_bytes,
                max_num_seqs=args.max_num_seqs,
                **CONFIGS[name],
            )
        )
        rows.append(
            MemoryRow(
                name,
                engines[name].runner.model.weight_bytes,
                0.0,
                round(time.perf_counter() - start, 1),
            )
        )
    base = next((r.weight_bytes for r in rows if r.config == "bf16"), rows[0].weight_bytes)
    rows = [
        MemoryRow(r.config, r.weight_bytes, round(r.weight_bytes / base, 3), r.load_s) for r in rows
    ]
    for row in rows:
        print(json.dumps(asdict(row)), flush=True)
    return engines, rows


def bench_speed(args, engines: dict, tokenizer) -> list[SpeedRow]:
    for engine in engines.values():
        decode_tok_s(engine, [tokenizer.encode_chat(c) for c in chat_prompts(2)], 4)  # warm-up
    rows: list[SpeedRow] = []
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [tokenizer.encode_chat(conv) for conv in chat_prompts(c)]
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():  # interleaved at each level
                best[name] = max(
                    best.get(name, 0.0), decode_tok_s(engine, prompts, args.max_tokens)
                )
        base = best.get("bf16", next(iter(best.values())))
        for name, tok_s in best.items():
            rows.append(SpeedRow(name, c, round(tok_s, 1), round(tok_s / base, 2)))
            print(json.dumps(asdict(rows[-1])), flush=True)
    return rows


def quality_pairs(names: list[str]) -> list[tuple[str, str]]:
    """fp32 alone (the reference), bf16 alone, then per INT4 configuration: bf16 prefill with
    INT4 decode, and INT4 for both."""
    pairs = [(n, n) for n in ("fp32", "bf16") if n in names]
    for name in (n for n in names if n.startswith("int4")):
        pairs += [("bf16", name)] if "bf16" in names else []
        pairs.append((name, name))
    return pairs


def run_weights_bench(args: argparse.Namespace) -> int:
    run = BenchRun()
    if args.quick:
        args.concurrency, args.max_tokens, args.repeats = "1,2", 8, 1
        args.prefill_tokens = min(args.prefill_tokens, 128)
        args.quality_tokens, args.text_tokens = 8, 128
    engines, memory = load_engines(args)  # each loads its own file: load_s is comparable
    tokenizer = next(iter(engines.values())).tokenizer
    speed = bench_prefill(args, engines, tokenizer) + bench_speed(args, engines, tokenizer)
    gc.collect()
    pairs = quality_pairs(list(engines))
    quality, text_tokens = bench_quality(
        engines,
        pairs,
        tokenizer,
        Path(args.text).read_text(),
        args.text_tokens,
        args.quality_tokens,
    )
    report = {
        **run.header(),
        "model": args.model,
        "max_tokens": args.max_tokens,
        "prefill_tokens": args.prefill_tokens,
        "repeats": args.repeats,
        "text_tokens": text_tokens,
        "quality_tokens": args.quality_tokens,
        **run.footer(),
        "memory": [asdict(r) for r in memory],
        "speed": [asdict(r) for r in speed],
        "quality_reference": "{}->{}".format(*pairs[0]),
        "quality": [asdict(r) for r in quality],
    }
    print(markdown(report))
    write_report(report, args.output)
    return 0


def _line(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(report: dict) -> str:
    r = report
    levels = sorted({s["concurrency"] for s in r["speed"]})
    title = {0: f"prefill tok/s, {r.get('prefill_tokens')} tokens (vs bf16)"}
    out = [
        f"{r['date']} {r['machine']}, torch {r['torch']} ({r['torch_threads']} threads), "
        f"model {r['model']}; `{r['command']}`\n",
        _line(
            "weights",
            "weight bytes",
            "vs bf16",
            "load s",
            *(title.get(c, f"decode tok/s @{c} (vs bf16)") for c in levels),
        ),
        _line("---", "---:", "---:", "---:", *("---:" for _ in levels)),
    ]
    for m in r["memory"]:
        speeds = {s["concurrency"]: s for s in r["speed"] if s["config"] == m["config"]}
        out.append(
            _line(
                m["config"],
                f"{m['weight_bytes']:,}",
                f"**{m['vs_bf16']}x**",
                m["load_s"],
                *(f"{speeds[c]['decode_tok_s']} (**{speeds[c]['vs_bf16']}x**)" for c in levels),
            )
        )
    ref = r["quality_reference"]
    out += [
        f"\nQuality: perplexity of tokens {r['text_tokens'] // 2 + 1}..{r['text_tokens'] - 1} of "
        f"the text (the first half's KV from the prefill precision); greedy tokens equal to "
        f"{ref}'s (of {r['quality_tokens']}) per prompt\n",
        _line("prefill", "decode", "perplexity", f"vs {ref}", "greedy = ref (mean)", "per prompt"),
        _line("---", "---", "---:", "---:", "---:", "---"),
    ]
    for q in r["quality"]:
        out.append(
            _line(
                q["prefill"],
                q["decode"],
                f"{q['perplexity']:.3f}",
                f"{100 * q['ppl_vs_reference']:+.2f} %",
                q["greedy_mean"],
                ", ".join(map(str, q["greedy_prefix"])),
            )
        )
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {list(CONFIGS)}")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=2000,
        help="one prompt this long, prefilled per configuration (0: skip)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-bytes", type=int, default=320 << 20)
    parser.add_argument("--quality-tokens", type=int, default=64)
    parser.add_argument("--text", default=str(TEXT), help="text for perplexity")
    parser.add_argument("--text-tokens", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--output", default=None, help="also write the JSON report here")
