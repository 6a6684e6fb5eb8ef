"""Speculative decoding in the engine: greedy output is unchanged with either proposer, and with
sampling the output distribution is unchanged (chi-square on a tiny random model)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.spec.policy import FixedPolicy
from kvmesh.engine.spec.prompts import chat_prompts, split, structured_prompts
from kvmesh.engine.spec.proposer import BlindProposer

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def _held_out(llm, n: int = 4) -> list[list[int]]:
    _, held = split(chat_prompts() + structured_prompts(), 24)
    return [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in held[:n]]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_output_is_unchanged_by_speculation(llm, method):
    spec = LLM(dtype="fp32", kv_cache_bytes=64 << 20, speculative=method)
    prompts = _held_out(llm)
    llm.engine.block_manager.reset_prefix_cache()
    want = [o.token_ids for o in llm.generate_ids(prompts, GREEDY)]
    assert [o.token_ids for o in spec.generate_ids(prompts, GREEDY)] == want  # batched
    assert spec.generate_ids(prompts[:1], GREEDY)[0].token_ids == want[0]  # alone
    stats = spec.engine.speculator.stats
    assert stats.steps > 0 and stats.draft_tokens > 0
    assert spec.engine.block_manager.num_used_pages == 0
    spec.engine.block_manager.check_integrity()


class _Oracle(BlindProposer):
    """Deterministic drafts: the target's two most likely continuations of one fixed history
    (right for some samples, wrong for the others: both paths get exercised)."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, seq, limit):
        return self.drafts[:limit]

    def release(self, seq_ids, force=False):
        pass


def _tiny(tmp_path, default_model_source) -> str:
    from transformers import AutoConfig

    from tests.integration.test_parity import _save_tiny

    config = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.5,
    )
    return _save_tiny(tmp_path, default_model_source, config)


def test_sampled_output_distribution_is_unchanged(tmp_path, default_model_source):
    path = _tiny(tmp_path, default_model_source)
    llm = LLM(
        model=path,
        dtype="fp32",
        kv_cache_bytes=64 << 20,
        max_num_seqs=256,
        speculative="ngram",
        num_speculative_tokens=2,
    )
    prompt = list(range(30, 36))
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    probs = lambda ids: torch.softmax(llm.engine.score(prompt + ids)[-1], -1)  # noqa: E731
    first = int(probs([]).argmax())
    second = int(probs([first]).argmax())
    llm.engine.speculator.proposer = _Oracle([second, int(probs([first, second]).argmax())])
    llm.engine.speculator.policy = FixedPolicy(
        2
    )  # 256 at once: the adaptive policy would not draft
    n = 1500
    outs = llm.generate_ids([prompt] * n, params)
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert llm.engine.speculator.stats.accepted_tokens > 0  # drafts were accepted ...
    assert llm.engine.speculator.stats.accepted_tokens < llm.engine.speculator.stats.draft_tokens
    chi2, cells = 0.0, 0
    for a in probs([]).topk(3).indices.tolist():
        for b in probs([a]).topk(3).indices.tolist():
            for c in probs([a, b]).topk(3).indices.tolist():
                p = (
                    _topk_prob(probs([]), a)
                    * _topk_prob(probs([a]), b)
                    * _topk_prob(probs([a, b]), c)
                )
                expected = p * n
                chi2 += (counts[(a, b, c)] - expected) ** 2 / expected
                cells += 1
    assert sum(counts.values()) == n and len(counts) <= cells
    df = cells - 1
    assert chi2 < df + 5 * math.sqrt(2 * df), (chi2, df)  # 5 sd: p < 1e-5 by chance


def _topk_prob(p: torch.Tensor, token: int, k: int = 3) -> float:
    top = p.topk(k)
    return float(top.values[top.indices.tolist().index(token)] / top.values.sum())
