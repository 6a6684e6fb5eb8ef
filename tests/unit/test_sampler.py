"""Sampler: greedy, truncation, distribution, seeds, penalties and logprobs on small random logits."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.runner.sampler import Sampler, apply_penalties

VOCAB = 50
_ids = itertools.count()


def seq(
    prompt: list[int] | None = None, output: tuple[int, ...] | list[int] = (), **params: object
) -> Sequence:
    s = Sequence(f"seq-{next(_ids)}", list(prompt or [1, 2, 3]), SamplingParams(**params))
    for token in output:
        s.append_token(token)
    return s


def random_logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def draws(logits_row: torch.Tensor, n: int, **params: object) -> torch.Tensor:
    """n independent unseeded draws from one row, as one batch."""
    out = Sampler()(logits_row.expand(n, -1), [seq(**params) for _ in range(n)])
    return torch.tensor(out.token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(8).to(dtype)
    out = Sampler()(logits, [seq(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_mixed_batch_greedy_rows_exact_and_sampled_rows_in_support() -> None:
    logits = random_logits(6, seed=1)
    seqs = [seq(temperature=0.0 if i % 2 == 0 else 1.0, top_k=3) for i in range(6)]
    torch.manual_seed(0)
    for _ in range(50):
        tokens = Sampler()(logits, seqs).token_ids
        for i, token in enumerate(tokens):
            if i % 2 == 0:
                assert token == logits[i].argmax().item()
            else:
                assert token in logits[i].topk(3).indices.tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(16, seed=2, scale=0.5)
    out = Sampler()(logits, [seq(temperature=1.5, top_k=1) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_sampling_does_not_modify_input_logits() -> None:
    logits = random_logits(4, seed=3)
    before = logits.clone()
    seqs = [
        seq(
            output=[5, 5],
            temperature=0.8,
            top_p=0.9,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        )
        for _ in range(4)
    ]
    Sampler()(logits, seqs)
    assert torch.equal(logits, before)


def test_top_p_never_picks_excluded_tokens() -> None:
    row = random_logits(1, seed=4, scale=2.0)[0]
    probs = row.softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    allowed = set(order[before < 0.6].tolist())  # smallest prefix with mass >= 0.6
    assert 1 < len(allowed) < VOCAB
    torch.manual_seed(1)
    picked = set(draws(row, 4000, top_p=0.6).tolist())
    assert picked <= allowed
    assert len(picked) == len(allowed)  # and every allowed token shows up


def test_top_p_keeps_the_top_token_even_when_it_alone_exceeds_top_p() -> None:
    row = torch.zeros(VOCAB)
    row[7] = 10.0
    torch.manual_seed(2)
    assert set(draws(row, 500, top_p=0.1).tolist()) == {7}


def test_min_p_never_picks_excluded_tokens() -> None:
    row = random_logits(1, seed=5, scale=2.0)[0]
    probs = row.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.05 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < VOCAB
    torch.manual_seed(3)
    picked = set(draws(row, 4000, min_p=0.05).tolist())
    assert picked <= allowed
    assert len(picked) == len(allowed)


def test_top_k_top_p_min_p_combined_stay_in_intersection() -> None:
    row = random_logits(1, seed=6, scale=1.0)[0]
    top5 = set(row.topk(5).indices.tolist())
    torch.manual_seed(4)
    picked = set(draws(row, 2000, top_k=5, top_p=0.95, min_p=0.01).tolist())
    assert picked <= top5


def test_temperature_sampling_frequencies_match_softmax() -> None:
    row = random_logits(1, seed=7, scale=1.5)[0]
    n = 20_000
    torch.manual_seed(5)
    tokens = draws(row, n, temperature=0.7)
    freq = torch.bincount(tokens, minlength=VOCAB).double() / n
    expected = (row.double() / 0.7).softmax(-1)
    bound = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-3
    assert torch.all((freq - expected).abs() <= bound), (freq - expected).abs().max()


@pytest.mark.parametrize("uniform", [0.0, 1.0 - 2**-24])
def test_a_draw_at_either_end_of_the_uniform_picks_a_token_of_positive_probability(
    monkeypatch, uniform: float
) -> None:
    """The inverse-CDF draw: tokens filtered to probability 0 at both ends of the vocabulary are
    never picked, not even when the uniform is 0 or as close to 1 as float32 gets."""
    row = torch.full((1, VOCAB), float("-inf"))
    row[0, 10:20] = torch.linspace(0.0, 1.0, 10)
    sampler = Sampler()
    monkeypatch.setattr(
        sampler, "_uniforms", lambda seqs, device: torch.full((len(seqs), 1), uniform)
    )
    token = sampler(row, [seq(temperature=1.0)]).token_ids[0]
    assert token == (10 if uniform == 0.0 else 19)


def test_a_row_holding_nan_or_inf_still_gets_a_token_of_the_vocabulary() -> None:
    rows = random_logits(3)
    rows[0, 5] = float("nan")
    rows[1, 7] = float("inf")
    out = Sampler()(rows, [seq(temperature=1.0) for _ in range(3)]).token_ids
    assert all(0 <= t < VOCAB for t in out)
    assert out[1] == 7


def test_one_uniform_per_row_is_drawn_whatever_the_vocabulary() -> None:
    """A seeded row's generator advances by one number per draw (what replay_draw skips when
    the first token was sampled on another worker)."""
    sampler, target = Sampler(), seq(seed=99, temperature=1.0)
    sampler(random_logits(1), [target])
    replayed = Sampler()
    replayed.replay_draw(seq_b := seq(seed=99, temperature=1.0), VOCAB)
    assert torch.equal(sampler.generator(target).get_state(), replayed.generator(seq_b).get_state())


def test_seeded_row_reproducible_whatever_the_batch() -> None:
    row = random_logits(1, seed=8, scale=0.5)
    alone, crowded = Sampler(), Sampler()
    target_a, target_b = seq(seed=1234), seq(seed=1234)
    got_alone, got_crowded = [], []
    for step in range(20):
        got_alone.append(alone(row, [target_a]).token_ids[0])
        others = [seq(temperature=t) for t in (0.0, 1.0, 0.5)][: step % 4]
        batch = others[:]
        batch.insert(step % (len(others) + 1), target_b)  # move the seeded row around
        logits = random_logits(len(batch), seed=100 + step)
        logits[batch.index(target_b)] = row[0]
        got_crowded.append(crowded(logits, batch).token_ids[batch.index(target_b)])
    assert got_alone == got_crowded
    assert len(set(got_alone)) > 1  # really sampling, not a constant


def test_different_seeds_differ() -> None:
    flat = torch.zeros(1, VOCAB)
    sampler = Sampler()
    a, b = seq(seed=1), seq(seed=2)
    tokens_a = [sampler(flat, [a]).token_ids[0] for _ in range(10)]
    tokens_b = [sampler(flat, [b]).token_ids[0] for _ in range(10)]
    assert tokens_a != tokens_b


def test_release_resets_the_generator() -> None:
    flat = torch.zeros(1, VOCAB)
    sampler = Sampler()
    s = seq(seed=42)
    first = [sampler(flat, [s]).token_ids[0] for _ in range(8)]
    continued = [sampler(flat, [s]).token_ids[0] for _ in range(8)]
    sampler.release(s.seq_id)
    replayed = [sampler(flat, [s]).token_ids[0] for _ in range(8)]
    assert replayed == first
    assert continued != first
    sampler.release("never-seen")  # no error


def test_repetition_penalty_hf_semantics_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    s = seq(prompt=[0, 1], output=[2, 0], repetition_penalty=2.0)
    out = apply_penalties(logits, [s])
    assert out.tolist() == [[1.0, -4.0, 0.5, -1.0, 0.5, 3.0]]


def test_presence_and_frequency_openai_semantics_over_output_only() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    s = seq(prompt=[4, 4, 5], output=[1, 1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [s])
    expected = [2.0, -2.0 - 0.5 - 0.75, 1.0, -1.0 - 0.5 - 0.25, 0.5, 3.0]
    assert out.tolist() == [expected]


def test_penalties_match_the_formulas_on_a_mixed_batch() -> None:
    logits = random_logits(4, seed=9)
    seqs = [
        seq(prompt=[1, 2, 3], output=[3, 7, 7], repetition_penalty=1.5),
        seq(prompt=[9], output=[9, 4, 4, 4], presence_penalty=-0.7, frequency_penalty=0.3),
        seq(
            prompt=[10, 11],
            output=[11, 12],
            repetition_penalty=0.8,
            presence_penalty=1.0,
            frequency_penalty=-1.2,
        ),
        seq(prompt=[1, 2], output=[2, 2]),  # neutral row must be untouched
    ]
    expected = logits.clone()
    for row, s in enumerate(seqs):
        p = s.params
        for token in set(s.token_ids):
            value = expected[row, token]
            expected[row, token] = (
                value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            )
        for token in set(s.output_token_ids):
            count = s.output_token_ids.count(token)
            expected[row, token] -= p.presence_penalty + p.frequency_penalty * count
    assert torch.allclose(apply_penalties(logits, seqs), expected, atol=1e-6)
    assert torch.equal(apply_penalties(logits, seqs)[3], logits[3])


def test_greedy_rows_apply_penalties() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 2.0
    logits[:, 6] = 1.5
    seqs = [
        seq(output=[5], temperature=0.0, repetition_penalty=2.0),
        seq(output=[5], temperature=0.0, frequency_penalty=1.0),
    ]
    assert Sampler()(logits, seqs).token_ids == [6, 6]


def test_logprobs_are_from_the_raw_distribution() -> None:
    logits = random_logits(4, seed=10)
    seqs = [
        seq(output=[3, 3], temperature=0.6, top_k=10, repetition_penalty=1.4, logprobs=5),
        seq(temperature=0.0, logprobs=0),
        seq(temperature=1.0),
        seq(temperature=1.0, top_p=0.8, logprobs=20),
    ]
    torch.manual_seed(6)
    out = Sampler()(logits, seqs)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 0), (3, 20)):
        lp = out.logprobs[row]
        assert lp is not None
        token = out.token_ids[row]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert lp.rank == int((raw[row] > raw[row, token]).sum()) + 1
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for token_id, value in lp.top:
            assert value == pytest.approx(raw[row, token_id].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == raw[row].topk(n).indices.tolist()
    assert out.logprobs[1].rank == 1  # greedy pick is the most likely token


def test_logprobs_rank_of_a_low_ranked_token() -> None:
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)  # token 49 most likely
    s = seq(output=[49], repetition_penalty=2.0, temperature=0.0, logprobs=2)
    logits[0, 49] = 49.5  # penalised to 24.75: greedy now picks 48
    out = Sampler()(logits, [s])
    assert out.token_ids == [48]
    assert out.logprobs[0].rank == 2
    assert [t for t, _ in out.logprobs[0].top] == [49, 48]
