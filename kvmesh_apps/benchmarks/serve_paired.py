"""The mesh against the in-process engine, request by request (`kvmesh bench serve` without
`--url`): for each compared level C, rounds of C prompts through `LLM.chat` (same dtype and KV
budget as a worker) and then the same C prompts through the running mesh, one right after the
other. The mesh sits idle while the engine runs, and the engine's pool stays allocated while the
mesh runs, so neither is measured minutes apart on a machine whose speed drifts (this VM's does
by 20-30 % within minutes): mesh p50 / engine p50 over the same rounds."""

from __future__ import annotations

import gc
import time
from typing import Any

from kvmesh import event_loop
from kvmesh.mesh.affinity import thread_kept_to
from kvmesh_apps.benchmarks.serve_client import Messages, RequestTiming, Target
from kvmesh_apps.benchmarks.serve_suite import TOPICS, client_loops, requests_for, summarize

WORKER_KV_CACHE_BYTES = 512 << 20  # `kvmesh serve decode|prefill` default --kv-cache-mib
MIN_ROUNDS = 3


def paired_prompts(concurrency: int, n: int) -> list[Messages]:
    """Their own text, so neither the levels nor the rounds share a prefix-cache entry."""
    return [
        [
            {
                "role": "user",
                "content": f"Pair {concurrency}, request {i}: write a short story "
                f"about {TOPICS[i % len(TOPICS)]}.",
            }
        ]
        for i in range(n)
    ]


def measure_paired(
    target: Target,
    dtype: str,
    levels: list[int],
    requests_per_level: int | None,
    max_tokens: int,
    weights: str = "auto",
    client_cpus: frozenset[int] | None = None,
) -> tuple[dict[int, dict], dict[int, dict]]:
    """(engine, mesh) summaries per level, from the same interleaved rounds; the mesh's client
    on `client_cpus` (the engine on every CPU, as a worker's)."""
    from kvmesh import LLM, SamplingParams

    llm = LLM(
        model=target.model, dtype=dtype, weights=weights, kv_cache_bytes=WORKER_KV_CACHE_BYTES
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.chat(paired_prompts(0, 2), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    engine, mesh = {}, {}
    try:
        for c in levels:
            rounds = max(requests_for(c, requests_per_level) // c, MIN_ROUNDS)
            prompts = paired_prompts(c, c * rounds)
            timings: dict[str, list[RequestTiming]] = {"engine": [], "mesh": []}
            wall = {"engine": 0.0, "mesh": 0.0}
            for r in range(rounds):
                chunk = prompts[r * c : (r + 1) * c]
                started = time.perf_counter()
                outs = llm.chat(chunk, params)
                wall["engine"] += time.perf_counter() - started
                timings["engine"] += [engine_timing(o, max_tokens) for o in outs]
                with thread_kept_to(client_cpus):
                    got, spent = event_loop.run(client_loops(target, list(chunk), c, max_tokens))
                timings["mesh"] += got
                wall["mesh"] += spent
            engine[c] = summarize("engine", c, timings["engine"], wall["engine"])
            mesh[c] = summarize("mesh, paired", c, timings["mesh"], wall["mesh"])
    finally:
        del llm
        gc.collect()
    return engine, mesh


def engine_timing(out: Any, max_tokens: int) -> RequestTiming:
    n = len(out.token_ids)
    tpot = (out.total_s - out.ttft_s) / (n - 1) if n > 1 else None
    return RequestTiming(out.ttft_s, tpot, n, len(out.prompt_token_ids), "engine", n == max_tokens)
