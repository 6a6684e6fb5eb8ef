"""`kvmesh bench kv`, table 3: FP32 vs BF16 vs FP8 KV quality under one fp32 model, and the
markdown rendering of the whole report."""

from __future__ import annotations

import gc
import json
import math
from dataclasses import asdict, dataclass

QUESTIONS = (  # the quality table's greedy prompts
    *("Explain why the sky is blue.", "Write a haiku about autumn leaves."),
    *("What is a prime number? Give three examples.", "Describe how a bicycle works."),
    *("Give me a simple recipe for pancakes.", "Summarize the plot of Romeo and Juliet."),
)


@dataclass(frozen=True)
class QualityRow:
    kv_dtype: str
    perplexity: float
    ppl_vs_fp32: float  # relative difference
    top1_agree: float  # teacher-forced argmax equal to FP32 KV's, share of positions
    greedy_prefix: tuple[int, ...]  # tokens before the first divergence from FP32 KV, per prompt


def bench_quality(args, text: str, reference) -> tuple[list[QualityRow], int]:
    """FP32 (the integrity engine), BF16 and FP8 KV under the same fp32 model."""
    import torch
    import torch.nn.functional as F

    from kvmesh import LLM, SamplingParams

    tok = reference.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts = prompts[: args.quality_prompts]
    ids = tok.encode(text, add_special_tokens=False)[: args.text_tokens]
    target = torch.tensor(ids[1:])
    greedy = SamplingParams(max_tokens=args.quality_tokens, temperature=0.0, ignore_eos=True)
    rows: list[QualityRow] = []
    ref_tokens = ref_argmax = ref_ppl = None
    for kv in ("fp32", "bf16", "fp8_e4m3"):
        llm = (
            reference
            if kv == "fp32"
            else LLM(
                model=args.model,
                dtype=args.integrity_dtype,
                kv_dtype=kv,
                page_size=args.page_size,
                kv_cache_bytes=128 << 20,
                max_num_seqs=len(prompts),
            )
        )
        llm.engine.block_manager.reset_prefix_cache()
        tokens = [o.token_ids for o in llm.generate_ids(prompts, greedy)]
        logits = llm.engine.score(ids)[:-1]
        ppl = math.exp(F.cross_entropy(logits, target).item())
        argmax = logits.argmax(-1)
        if ref_tokens is None:
            ref_tokens, ref_argmax, ref_ppl = tokens, argmax, ppl
        prefix = tuple(common_prefix(a, b) for a, b in zip(tokens, ref_tokens, strict=True))
        rows.append(
            QualityRow(
                kv,
                round(ppl, 4),
                round(ppl / ref_ppl - 1, 5),
                round((argmax == ref_argmax).float().mean().item(), 4),
                prefix,
            )
        )
        print(json.dumps(asdict(rows[-1])), flush=True)
        if llm is not reference:
            del llm
            gc.collect()
    return rows, len(ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa: B905


def _line(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(report: dict) -> str:
    r = report
    out = [
        f"{r['date']} {r['machine']}, torch {r['torch']} ({r['torch_threads']} threads), "
        f"model {r['model']}; `{r['command']}`",
        f"\nThroughput, {r['dtype']} model, KV budget {r['kv_budget_bytes']:,} bytes "
        f"({r['kv_budget']}), ~{r['prompt_tokens']}-token prompts, {r['max_tokens']} tokens each\n",
        _line(
            "concurrency", "KV", "capacity tok", "max running", "preemptions", "tok/s", "FP8 / BF16"
        ),
        _line("---:", "---", "---:", "---:", "---:", "---:", "---:"),
    ]
    for t in r["throughput"]:
        ratio = "" if t["fp8_over_bf16"] is None else f"**{t['fp8_over_bf16']}**"
        out.append(
            _line(
                t["concurrency"],
                t["kv_dtype"],
                f"{t['capacity_tokens']:,}",
                t["max_running"],
                t["preemptions"],
                t["tok_s"],
                ratio,
            )
        )
    out += [
        f"\nIntegrity check, {r['integrity_dtype']} model, default KV, best of {r['repeats']} "
        "runs per mode (off/on alternating)\n",
        _line("concurrency", "off tok/s", "on tok/s", "on / off", "check us/step", "check share"),
        _line("---:", "---:", "---:", "---:", "---:", "---:"),
    ]
    for i in r["integrity"]:
        out.append(
            _line(
                i["concurrency"],
                i["off_tok_s"],
                i["on_tok_s"],
                i["on_over_off"],
                i["check_us_per_step"],
                f"{100 * i['check_fraction']:.3f} %",
            )
        )
    out += [
        f"\nQuality, {r['integrity_dtype']} model: perplexity on the first {r['text_tokens']} "
        f"tokens of the text; greedy tokens equal to FP32 KV's (of {r['quality_tokens']})\n",
        _line("KV", "perplexity", "vs FP32 KV", "top-1 = FP32 KV", "greedy prefix per prompt"),
        _line("---", "---:", "---:", "---:", "---"),
    ]
    for q in r["quality"]:
        out.append(
            _line(
                q["kv_dtype"],
                f"{q['perplexity']:.3f}",
                f"{100 * q['ppl_vs_fp32']:+.2f} %",
                f"{100 * q['top1_agree']:.1f} %",
                ", ".join(map(str, q["greedy_prefix"])),
            )
        )
    return "\n".join(out)
