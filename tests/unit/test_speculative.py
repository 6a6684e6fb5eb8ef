"""Speculative decoding pieces without a model: n-gram drafting, greedy verification, and a
statistical check that rejection sampling of deterministic drafts preserves the distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig
from kvmesh.engine.spec.ngram import NgramProposer
from kvmesh.engine.spec.verify import verify_greedy, verify_sampled


def _seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams())


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    seq = _seq([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert proposer.propose(seq, 10) == [7, 8, 1]  # latest earlier "1 2 3" is followed by 7 8 1
    assert proposer.propose(seq, 2) == [7, 8]
    seq.append_token(7)  # "2 3 7" now matches too
    assert proposer.propose(seq, 10) == [8, 1, 2]
    assert proposer.propose(_seq([5, 6, 7], "other"), 4) == []  # nothing repeats
    assert proposer.propose(seq, 0) == []


def test_ngram_index_is_incremental_and_released():
    proposer = NgramProposer(num_tokens=2, min_n=2, max_n=2)
    seq = _seq([4, 5, 6])
    assert proposer.propose(seq, 2) == []
    for token in (4, 5):
        seq.append_token(token)
    assert proposer.propose(seq, 2) == [6, 4]
    proposer.release(["s"])
    assert "s" not in proposer._indexes  # noqa: SLF001


def _one_hot_logits(choices: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("target", "draft", "emitted"),
    [
        ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 5, 3, 4], [1, 2, 3], [1, 5]),  # second draft rejected: target's token instead
        ([6, 2, 3, 4], [1, 2, 3], [6]),
        ([7], [], [7]),
    ],
)
def test_greedy_verification_keeps_the_longest_agreeing_prefix(target, draft, emitted):
    assert verify_greedy(_one_hot_logits(target), draft) == emitted


def test_block_manager_trim_frees_rejected_pages():
    bm = BlockManager(BlockManagerConfig(8, 4), BlockHasher(4, 1))
    seq = _seq(list(range(7)))
    assert bm.allocate(seq, 7)
    seq.num_computed_tokens = 6
    assert bm.allocate(seq, 1 + 6)  # last token + 6 drafts: positions 6..12 -> 4 pages
    assert len(seq.block_table) == 4 and len(seq.page_tags) == 4
    bm.trim(seq, 9)  # 2 drafts accepted + bonus: 9 tokens need 3 pages
    assert len(seq.block_table) == 3 and len(seq.page_tags) == 3
    bm.check_integrity([seq])


# ---- rejection sampling preserves the target distribution ----

VOCAB = 5


def _chain() -> torch.Tensor:
    """A fixed 'target model': p(next | previous token), [VOCAB, VOCAB]."""
    gen = torch.Generator().manual_seed(3)
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 1.5, dim=-1)


def _generate(chain, length: int, gen: torch.Generator, speculate: bool) -> tuple[int, ...]:
    out = [0]
    while len(out) <= length:
        if not speculate:
            out.append(int(torch.multinomial(chain[out[-1]], 1, generator=gen)))
            continue
        # A deliberately poor, deterministic proposer: "the previous token + 1", twice.
        draft = [(out[-1] + 1) % VOCAB, (out[-1] + 2) % VOCAB]
        context = [out[-1], *draft]
        probs = torch.stack([chain[t] for t in context])
        out.extend(verify_sampled(probs, draft, gen))
    return tuple(out[1 : length + 1])


def _chi2(chain: torch.Tensor, counts: Counter, n: int) -> tuple[float, int]:
    """Pearson chi-square of observed 3-token continuations of token 0 vs exact probabilities."""
    chi2, cells = 0.0, 0
    for a in range(VOCAB):
        for b in range(VOCAB):
            for c in range(VOCAB):
                expected = float(chain[0, a] * chain[a, b] * chain[b, c]) * n
                if expected >= 5:
                    chi2 += (counts[(a, b, c)] - expected) ** 2 / expected
                    cells += 1
    return chi2, cells - 1


def test_speculative_sampling_leaves_the_sequence_distribution_unchanged():
    chain, n = _chain(), 6000
    gen = torch.Generator().manual_seed(0)
    spec = Counter(_generate(chain, 3, gen, speculate=True) for _ in range(n))
    plain = Counter(_generate(chain, 3, gen, speculate=False) for _ in range(n))
    for counts in (spec, plain):  # plain sampling is the control
        chi2, df = _chi2(chain, counts, n)
        assert chi2 < df + 5 * math.sqrt(2 * df), (chi2, df)  # 5 sd: p < 1e-5


def test_the_chi_square_check_catches_a_biased_verifier(monkeypatch):
    """A verifier that accepts every draft shifts the distribution: the same check fails."""
    import tests.unit.test_speculative as module

    monkeypatch.setattr(module, "verify_sampled", lambda probs, draft, gen: [*draft, 0])
    chain, n = _chain(), 6000
    gen = torch.Generator().manual_seed(0)
    biased = Counter(_generate(chain, 3, gen, speculate=True) for _ in range(n))
    chi2, df = _chi2(chain, biased, n)
    assert chi2 > df + 5 * math.sqrt(2 * df)
