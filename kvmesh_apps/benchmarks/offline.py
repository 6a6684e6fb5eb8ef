"""`kvmesh bench offline`: kvmesh vs transformers `generate`, same weights, prompts and dtype.

Every figure is generated tokens per second of wall time for a whole batch of C requests,
each producing exactly `max_tokens` tokens (EOS ignored), measured in one process, one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

TOPICS = (
    "the ocean",
    "a small robot",
    "the history of bread",
    "mountains",
    "a city at night",
    "learning to code",
    "the moon",
    "coffee",
    "trains",
    "a library",
)


def chat_prompts(n: int) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}, part {i}.",
            }
        ]
        for i in range(n)
    ]


def bench_kvmesh(llm, conversations, max_tokens: int) -> float:
    from kvmesh import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def load_transformers(llm, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    source = llm.engine.source
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    if source.gguf_file is not None:
        return AutoModelForCausalLM.from_pretrained(
            str(source.gguf_file.parent), gguf_file=source.gguf_file.name, dtype=torch_dtype
        )
    return AutoModelForCausalLM.from_pretrained(str(source.hf_dir), dtype=torch_dtype)


def bench_transformers(model, tokenizer, conversations, max_tokens: int) -> float:
    import torch

    hf = tokenizer.hf
    hf.padding_side = "left"
    texts = [tokenizer.render_chat(c) for c in conversations]
    batch = hf(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=hf.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(texts) / elapsed


def run_offline_bench(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for dtype in args.dtype.split(","):
        rows += _bench_dtype(args, dtype, levels)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "torch_threads": _threads(),
        "model": args.model,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    print(_markdown(report))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


def _bench_dtype(args: argparse.Namespace, dtype: str, levels: list[int]) -> list[dict]:
    from kvmesh import LLM

    llm = LLM(model=args.model, dtype=dtype, max_num_seqs=max(levels))
    hf_model = None if args.no_transformers else load_transformers(llm, dtype)
    bench_kvmesh(llm, chat_prompts(2), 8)  # warm-up
    rows = []
    for c in levels:
        convs = chat_prompts(c)
        ours = bench_kvmesh(llm, convs, args.max_tokens)
        theirs = (
            bench_transformers(hf_model, llm.tokenizer, convs, args.max_tokens)
            if hf_model
            else None
        )
        rows.append(
            {
                "dtype": dtype,
                "concurrency": c,
                "kvmesh_tok_s": round(ours, 1),
                "transformers_tok_s": round(theirs, 1) if theirs else None,
                "ratio": round(ours / theirs, 2) if theirs else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _markdown(report: dict) -> str:
    lines = [
        f"{report['date']} {report['machine']}, model {report['model']}, "
        f"{report['max_tokens']} tokens per request",
        "| dtype | concurrency | kvmesh tok/s | transformers tok/s | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['concurrency']} | {r['kvmesh_tok_s']} "
            f"| {r['transformers_tok_s']} | {r['ratio']} |"
        )
    return "\n".join(lines)
