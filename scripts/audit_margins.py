"""Margin audit of the exact-equality tests (docs/internals.md, "What is exact").

For each pair of computations a test asserts equal: the largest logprob difference between them
along the shared greedy path, against the smallest top-1 / top-2 logprob gap on that path. A gap
far above the difference means no machine-level last-bit variation can flip a token.

    python scripts/audit_margins.py fp32|fp8|hf     (one JSON row per pair on stdout)
    python scripts/audit_margins.py fp8-quality     (FP8 vs FP32 KV: perplexity, top-1 agreement)

Run it again under other kernels (e.g. ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2) to compare.
"""

from __future__ import annotations

import json
import sys

import torch

from kvmesh import LLM, SamplingParams

SYSTEM = (
    "You are a meticulous assistant for a logistics company. Answer with short, precise "
    "sentences, cite the relevant policy section, and never invent shipment numbers. "
) * 2
PERSONAS = ["Ada, a sailor", "Bo, a baker", "Cy, a pilot", "Di, a chemist"]
PARITY = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "List three prime numbers.",
    "Explain recursion to a child in two sentences.",
]


def greedy(llm, prompts, n: int, reset: bool = True):
    if reset:
        llm.engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate_ids(prompts, params)


def _gap(lp) -> float:
    return lp.top[0][1] - lp.top[1][1]


def report(case: str, equal: bool, diff: float, gap: float) -> None:
    margin = gap / diff if diff else None
    row = {"case": case, "equal": equal, "max_logprob_diff": diff, "min_top2_gap": gap}
    print(json.dumps({**row, "margin": margin}), flush=True)


def compare(case: str, a_outs, b_outs) -> None:
    diff, gap, equal = 0.0, float("inf"), True
    for a, b in zip(a_outs, b_outs, strict=True):
        equal = equal and a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=False):
            if la.token_id != lb.token_id:
                break
            diff = max(diff, abs(la.logprob - lb.logprob))
            gap = min(gap, _gap(la), _gap(lb))
    report(case, equal, diff, gap)


def chat(llm, question: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    return llm.tokenizer.encode_chat([*messages, {"role": "user", "content": question}])


def audit_fp32() -> None:
    llm = LLM(dtype="fp32", max_num_seqs=32)
    prompt = chat(llm, "Where is shipment 7?", SYSTEM)
    cold = greedy(llm, [prompt], 24)
    compare("fp32 prefix hit vs cold", cold, greedy(llm, [prompt], 24, reset=False))
    qs = [
        chat(llm, f"Question {i}: name a colour and a number.", f"Persona {i}.") for i in range(8)
    ]
    alone = [greedy(llm, [q], 16)[0] for q in qs]
    compare("fp32 batch of 8 vs alone", greedy(llm, qs, 16), alone)
    trains = [chat(llm, f"Tell me fact number {i} about trains.") for i in range(6)]
    small = LLM(dtype="fp32", max_num_batched_tokens=32, kv_cache_bytes=64 << 20)
    compare(
        "fp32 chunked prefill 32 vs one chunk", greedy(llm, trains, 40), greedy(small, trains, 40)
    )
    spec = LLM(dtype="fp32", kv_cache_bytes=64 << 20, speculative="ngram")
    want = greedy(llm, trains[:4], 40)
    compare("fp32 ngram speculation vs none", want, greedy(spec, trains[:4], 40))
    int4 = LLM(dtype="fp32", weights="int4", kv_cache_bytes=32 << 20)
    rivers = [chat(llm, "Name three rivers.")]
    compare("int4 fp32-act vs dense fp32", greedy(llm, rivers, 24), greedy(int4, rivers, 24))


def audit_fp8() -> None:
    for chunk in (1024, 16):
        llm = LLM(
            dtype="fp32", kv_dtype="fp8_e4m3", kv_cache_bytes=48 << 20, max_num_batched_tokens=chunk
        )
        cold, warm = [], []
        for persona in PERSONAS:
            prompt = chat(llm, "Describe your morning.", f"{persona} speaks.")
            cold += greedy(llm, [prompt], 24)
            warm += greedy(llm, [prompt], 24, reset=False)
        compare(f"fp8 prefix hit vs cold, chunks of {chunk}", cold, warm)


def audit_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.loader import DEFAULT_MODEL, resolve_model

    gguf = resolve_model(DEFAULT_MODEL).gguf_file
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM(dtype="fp32")
    diff, gap, equal = 0.0, float("inf"), True
    for question in PARITY:
        ids = chat(llm, question)
        ours = greedy(llm, [ids], 64)[0]
        with torch.no_grad():
            logits = hf(torch.tensor([ids + ours.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
        for row, lp in zip(ref, ours.logprobs, strict=True):
            top2 = row.topk(2).values
            equal = equal and row.argmax().item() == lp.token_id
            diff = max(diff, abs(row[lp.token_id].item() - lp.logprob))
            gap = min(gap, (top2[0] - top2[1]).item(), _gap(lp))
    report("fp32 ours vs transformers, 4 x 64 greedy", equal, diff, gap)


def fp8_quality() -> None:
    """Teacher-forced on tests/data/public_domain.txt, its first 512 tokens and all of it."""
    import math
    from pathlib import Path

    import torch.nn.functional as F

    text = (Path(__file__).parents[1] / "tests" / "data" / "public_domain.txt").read_text()
    ref_llm = LLM(dtype="fp32", kv_cache_bytes=64 << 20)
    fp8 = LLM(dtype="fp32", kv_dtype="fp8_e4m3", kv_cache_bytes=48 << 20)
    all_ids = ref_llm.tokenizer.encode(text)
    for n in (512, len(all_ids)):
        ids, target = all_ids[:n], torch.tensor(all_ids[1:n])
        ref, got = ref_llm.engine.score(ids)[:-1], fp8.engine.score(ids)[:-1]
        ratio = math.exp(F.cross_entropy(got, target).item() - F.cross_entropy(ref, target).item())
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        row = {"tokens": n, "ppl_vs_fp32": round(100 * (ratio - 1), 2)}
        print(json.dumps({**row, "top1_agree": round(100 * agree, 1)}), flush=True)


if __name__ == "__main__":
    cases = {"fp32": audit_fp32, "fp8": audit_fp8, "hf": audit_transformers}
    {**cases, "fp8-quality": fp8_quality}[sys.argv[1]]()
