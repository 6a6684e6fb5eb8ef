"""`kvmesh bench spec --cost-profile`: seconds of one engine step with B decoding sequences and
k drafts each (never accepted: fixed tokens), relative to one plain decode row -- the shape
the speculation policy starts from (`STEP_PRIOR` in kvmesh/engine/spec/policy.py) before the
engine measures its own steps. Each (B, k) is timed in every round, rounds interleaved, and the
median kept, so a neighbour's burst on a shared machine moves few samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvmesh.engine.spec.policy import FixedPolicy
from kvmesh.engine.spec.prompts import chat_prompts
from kvmesh.engine.spec.proposer import BlindProposer


class _FixedDrafts(BlindProposer):
    """Drafts the same token k times: the verification rows cost what real drafts cost."""

    def __init__(self) -> None:
        self.k = 0

    def propose(self, seq, limit: int) -> list[int]:
        return [7] * min(self.k, limit)

    def release(self, seq_ids, force: bool = False) -> None:
        pass


def run_cost_profile(args: argparse.Namespace) -> int:
    from kvmesh import LLM, SamplingParams

    batches = [int(c) for c in args.concurrency.split(",")]
    drafts = sorted({0, 1, 2, args.num_speculative_tokens})
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_num_seqs=max(batches),
        speculative="ngram",
        num_speculative_tokens=max(drafts) or 1,
    )
    engine, proposer = llm.engine, _FixedDrafts()
    engine.speculator.proposer, engine.speculator.policy = proposer, FixedPolicy(max(drafts))
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in chat_prompts()]
    seconds: dict[tuple[int, int], float] = {}
    for batch in batches:
        ids = [f"cost-{batch}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, prompts * (batch // len(prompts) + 1), strict=False):
            engine.add_request(rid, prompt, params)
        proposer.k = 0
        for _ in range(3):  # prefill, then warm decode steps
            engine.step()
        samples: dict[int, list[float]] = {k: [] for k in drafts}
        for _ in range(args.rounds * 2):
            for k in drafts:
                proposer.k = k
                started = time.perf_counter()
                engine.step()
                samples[k].append(time.perf_counter() - started)
        for k, values in samples.items():
            seconds[(batch, k)] = statistics.median(values)
        for rid in ids:
            engine.abort(rid)
    return _report(args, seconds)


def _report(args: argparse.Namespace, seconds: dict[tuple[int, int], float]) -> int:
    unit = seconds[min(seconds)]  # the smallest batch's plain step
    print("| batch | drafts / seq | rows | step ms | relative to the first plain row |")
    print("|---:|---:|---:|---:|---:|")
    for (batch, k), value in sorted(seconds.items()):
        rows = batch * (1 + k)
        print(f"| {batch} | {k} | {rows} | {1000 * value:.1f} | {value / unit:.2f} |")
    if args.output:
        table = [
            {"batch": b, "drafts": k, "rows": b * (1 + k), "seconds": v}
            for (b, k), v in sorted(seconds.items())
        ]
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"cost_profile": table}, indent=1))
    return 0
