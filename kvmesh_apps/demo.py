"""`kvmesh up` for now: load the default model and run a short demo chat offline.

The mesh (gateway, prefill, decode over gRPC) replaces this in the next milestone.
"""

from __future__ import annotations

import time

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for writing clear Python code.",
    "Explain what a KV cache is in one sentence.",
)


def run_demo(model: str, dtype: str) -> int:
    from kvmesh import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model, dtype=dtype)
    print(
        f"kvmesh: loaded {llm.engine.model_name} ({llm.engine.config.compute_dtype}) in {time.perf_counter() - start:.1f}s; "
        f"KV pool {llm.engine.kv_cache.capacity_tokens} tokens"
    )
    params = SamplingParams(max_tokens=96, temperature=0.0)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in DEMO_QUESTIONS], params)
    for question, out in zip(DEMO_QUESTIONS, outputs, strict=True):
        print(f"\n> {question}\n{out.text.strip()}")
        print(
            f"  [{len(out.token_ids)} tokens, finish={out.finish_reason}, "
            f"ttft={out.ttft_s:.3f}s, decode={out.decode_tokens_per_s:.1f} tok/s]"
        )
    print("\nThe engine runs in-process for now; try: kvmesh generate --chat --prompt 'Hello'")
    return 0
