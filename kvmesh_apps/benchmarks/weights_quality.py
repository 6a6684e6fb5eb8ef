"""`kvmesh bench weights`, quality: what INT4 costs when only decode runs it and when prefill runs
it too. In one process, two engines stand for the two workers: the prompt's KV pages are
computed by the "prefill" engine and copied into the "decode" engine's pool (with their
integrity tags), as the transfer engine copies them between workers; the decode engine then
computes everything after the prompt.

- perplexity of the text's second half, its first half's KV computed by the prefill precision;
- greedy tokens equal to the fp32 engine's before the first divergence, per prompt.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, replace

from kvmesh_apps.benchmarks.kv_quality import QUESTIONS, common_prefix

_ids = itertools.count()


@dataclass(frozen=True)
class QualityRow:
    prefill: str
    decode: str
    perplexity: float  # of the scored half, its context's KV from `prefill`
    ppl_vs_reference: float  # relative difference to the first pair's (fp32)
    greedy_prefix: tuple[int, ...]  # greedy tokens equal to the reference's before divergence
    greedy_mean: float


def split_logits(prefill, decode, ids: list[int], context: int):
    """Logits predicting ids[context + 1:], computed by `decode` at positions context.. over the
    KV of ids[:context] that `prefill` computed (one engine alone when they are the same)."""
    from kvmesh import SamplingParams
    from kvmesh.engine.core.sequence import Sequence
    from kvmesh.engine.core.step import ChunkPlan, StepPlan

    if prefill is decode:
        return decode.score(ids)[context:-1]
    params = SamplingParams(max_tokens=1)
    head = Sequence(f"ctx-{next(_ids)}", ids[:context], params)
    whole = Sequence(f"all-{next(_ids)}", list(ids), params)
    if not prefill.block_manager.allocate(head, context):
        raise RuntimeError("the context does not fit in the prefill engine's pages")
    try:
        if not decode.block_manager.allocate(whole, len(ids)):
            raise RuntimeError("the text does not fit in the decode engine's pages")
        try:
            first = ChunkPlan(head.seq_id, 0, context, True)
            prefill.runner.score(
                StepPlan.one_shot(
                    head.seq_id, head.token_ids, head.block_table, head.page_tags, first
                )
            )
            pages = len(head.block_table)
            _copy_pages(prefill, head.block_table, decode, whole.block_table[:pages])
            rest = ChunkPlan(whole.seq_id, context, len(ids) - context, True)
            plan = StepPlan.one_shot(
                whole.seq_id, whole.token_ids, whole.block_table, whole.page_tags, rest
            )
            return decode.runner.score(plan)[:-1]
        finally:
            decode.block_manager.free(whole)
    finally:
        prefill.block_manager.free(head)


def split_greedy(prefill, decode, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens: `prefill` computes each prompt's KV and first token, `decode` reserves
    pages, receives the KV and tags, and generates the rest (the mesh's hand-over)."""
    from kvmesh import SamplingParams
    from kvmesh.engine.pool.integrity import as_int32

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = {f"g-{next(_ids)}": p for p in prompts}
    if prefill is decode:
        return _run(decode, rids, params)
    first = _run(prefill, rids, replace(params, max_tokens=1), keep_pages=True)
    out: dict[str, list[int]] = {}
    for rid, prompt in rids.items():
        reservation = decode.handover.reserve(rid, prompt, params)
        if reservation is None:
            raise RuntimeError("the decode engine's pool is full")
        done = reservation.cached_pages
        source = prefill.handover.pages_of(rid)[done : len(reservation.page_ids)]
        target = reservation.page_ids[done : done + len(source)]
        _copy_pages(prefill, source, decode, target)
        decode.kv_cache.tags[target] = as_int32(reservation.page_tags[done : done + len(source)])
        prefill.handover.release(rid)
        out[rid] = list(
            decode.handover.commit_prefilled(rid, first.pop(0)[0], None, 0).new_token_ids
        )
    return _drain(decode, out)


def _run(engine, rids: dict[str, list[int]], params, keep_pages: bool = False) -> list[list[int]]:
    for rid, prompt in rids.items():
        engine.add_request(rid, prompt, params, keep_pages=keep_pages)
    return _drain(engine, {rid: [] for rid in rids})


def _drain(engine, out: dict[str, list[int]]) -> list[list[int]]:
    """Step until every request finishes, appending each one's tokens to out[request id]."""
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id] += step.new_token_ids
    return list(out.values())


def _copy_pages(src, src_pages: list[int], dst, dst_pages: list[int]) -> None:
    if src.kv_cache.spec != dst.kv_cache.spec:
        raise RuntimeError("prefill and decode engines need one KV page layout")
    dst.kv_cache.pool[dst_pages] = src.kv_cache.pool[src_pages]


def bench_quality(
    engines: dict,
    pairs: list[tuple[str, str]],
    tokenizer,
    text: str,
    text_tokens: int,
    max_tokens: int,
) -> tuple[list[QualityRow], int]:
    """One row per (prefill, decode) pair of engine names, and the number of text tokens used.
    The first pair is the reference the rows are compared with (fp32 in the full run)."""
    import torch
    import torch.nn.functional as F

    ids = tokenizer.encode(text, add_special_tokens=False)[:text_tokens]
    context = len(ids) // 2
    target = torch.tensor(ids[context + 1 :])
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    rows: list[QualityRow] = []
    ref_ppl = ref_tokens = None
    for p, d in pairs:
        prefill, decode = engines[p], engines[d]
        for engine in {id(e): e for e in (prefill, decode)}.values():
            engine.block_manager.reset_prefix_cache()
        logits = split_logits(prefill, decode, ids, context)
        ppl = math.exp(F.cross_entropy(logits.float(), target).item())
        tokens = split_greedy(prefill, decode, prompts, max_tokens)
        if ref_ppl is None:
            ref_ppl, ref_tokens = ppl, tokens
        prefix = tuple(common_prefix(a, b) for a, b in zip(tokens, ref_tokens, strict=True))
        rows.append(
            QualityRow(
                p,
                d,
                round(ppl, 4),
                round(ppl / ref_ppl - 1, 5),
                prefix,
                round(sum(prefix) / len(prefix), 1),
            )
        )
        print(json.dumps(asdict(rows[-1])), flush=True)
    return rows, len(ids)
