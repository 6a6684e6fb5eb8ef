"""The adaptive speculation policy without a model: measured cost curves, acceptance rates,
and the draft lengths they lead to at small and large batch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh.engine.spec.cost import (
    CostCurve,
    GainCheck,
    PriorCurve,
    SpecFit,
    StepCosts,
    StepSample,
    bucket,
)
from kvmesh.engine.spec.policy import (
    AcceptanceTracker,
    AdaptivePolicy,
    Candidate,
    FixedPolicy,
    PolicyConfig,
)

LINEAR = ((1, 1.0), (2, 2.0))  # compute bound: every row costs the same
FLAT = ((1, 1.0), (64, 1.0))  # memory bound: rows are free


def test_buckets_are_exact_then_four_per_doubling():
    assert [bucket(n) for n in (1, 7, 16)] == [1, 7, 16]
    assert bucket(17) == 16 and bucket(19) == 19 and bucket(66) == 64 and bucket(70) == 76
    assert {bucket(n) for n in range(17, 129)} == {
        16,
        19,
        23,
        27,
        32,
        38,
        45,
        54,
        64,
        76,
        91,
        108,
        128,
    }


def test_prior_curve_interpolates_and_extends_its_last_slope():
    prior = PriorCurve(((1, 1.0), (3, 2.0), (5, 2.5)))
    assert prior(0) == 1.0 and prior(2) == 1.5 and prior(4) == 2.25 and prior(7) == 3.0
    with pytest.raises(ValueError):
        PriorCurve(((2, 1.0), (1, 2.0)))


def test_cost_curve_scales_the_prior_by_what_it_measured():
    curve = CostCurve(PriorCurve(((1, 1.0), (8, 2.0), (16, 4.0))), window=5)
    assert curve.estimate(4) is None
    curve.record(1, 0.010)
    assert curve.estimate(1) == pytest.approx(0.010)
    assert curve.estimate(16) == pytest.approx(0.040)  # the prior's shape at the level measured
    curve.record(16, 0.080)  # measured twice the prior's 16-row cost
    assert curve.estimate(16) == pytest.approx(0.080)
    # in between, the measured/prior ratio is interpolated: 1 at 1 row, 2 at 16
    assert curve.estimate(8) == pytest.approx(0.020 * (1 + 7 / 15))


def test_cost_curve_keeps_the_median_of_its_latest_samples():
    curve = CostCurve(PriorCurve(LINEAR), window=3)
    for seconds in (0.010, 0.500, 0.011):  # a neighbour's burst
        curve.record(4, seconds)
    assert curve.estimate(4) == pytest.approx(0.011)
    for seconds in (0.020, 0.021, 0.022):  # older samples leave the window
        curve.record(4, seconds)
    assert curve.estimate(4) == pytest.approx(0.021)


def test_acceptance_counts_only_the_drafts_that_were_tried():
    tracker = AcceptanceTracker(prior=0.5, global_weight=0.5, memory=10**6, shrink=0.0)
    tracker.record("a", drafted=4, accepted=4)  # four accepted trials
    assert tracker.rate("a") == 1.0
    tracker.record("b", drafted=4, accepted=1)  # one accepted, one rejected, two never tried
    assert tracker.rate("b") == pytest.approx(0.5)
    assert tracker.rate("new") == tracker.overall  # a new sequence starts at the global rate
    before = tracker.overall
    tracker.record("c", drafted=0, accepted=0)
    assert tracker.overall == before
    tracker.forget("a")
    assert tracker.rate("a") == tracker.overall


def test_a_young_sequence_is_shrunk_toward_the_global_rate_and_old_trials_fade():
    tracker = AcceptanceTracker(prior=0.5, global_weight=1e-9, memory=4, shrink=4.0)
    tracker.record("s", drafted=1, accepted=0)  # one rejection: (0 + 4 * 0.5) / (1 + 4)
    assert tracker.rate("s") == pytest.approx(0.4)
    for _ in range(40):
        tracker.record("s", drafted=1, accepted=1)
    # decayed counts: about `memory` trials, all accepted now, against the 4 pseudo-trials
    assert tracker.rate("s") == pytest.approx((4 + 2) / (4 + 4), abs=0.01)


def test_spec_fit_separates_a_chunks_own_cost_from_its_draft_rows():
    fit = SpecFit(window=8)
    for chunks, drafts in ((4, 4), (4, 8), (2, 8), (8, 8)):
        fit.record(chunks, drafts, chunks * 0.003 + drafts * 0.002)  # a = 3 ms, r = 2 ms
    assert fit.surplus(1, 0, prior_row=1.0) == pytest.approx(0.003)
    assert fit.surplus(3, 9, prior_row=1.0) == pytest.approx(0.009 + 0.018)
    fit.record(4, 4, 5.0)  # a neighbour's burst moves neither
    assert fit.surplus(3, 9, prior_row=1.0) == pytest.approx(0.027)


def test_spec_fit_takes_the_prior_row_cost_until_drafts_per_chunk_vary():
    fit = SpecFit(window=8)
    assert fit.surplus(1, 1, prior_row=0.001) is None
    fit.record(2, 4, 0.010)  # 2 drafts per chunk: x = 2, y = 5 ms
    assert fit.surplus(1, 2, prior_row=0.001) == pytest.approx(0.005)
    assert fit.surplus(1, 4, prior_row=0.001) == pytest.approx(0.003 + 0.004)


def test_step_costs_fall_back_to_the_plain_slope_and_the_chunk_prior():
    costs = StepCosts(PriorCurve(LINEAR), chunk_prior=0.5)
    costs.record(StepSample(8, 0, 0, 0.080))
    # plain 80 ms; 8 draft rows at the curve's slope (10 ms); 4 chunks of half a 10 ms row
    assert costs.step(8, 8, 4) == pytest.approx(0.080 + 0.080 + 0.020)
    costs.record(StepSample(8, 8, 4, 0.200, 8, 0.004))  # measured: surplus 120 ms
    assert costs.step(8, 8, 4) == pytest.approx(0.200 + 0.004)
    assert costs.step(8, 0, 0) == pytest.approx(0.080)
    costs.record(StepSample(64, 1, 1, 0.700, 1, 0.001))  # batch 64 has its own fit
    assert costs.step(8, 8, 4) == pytest.approx(0.204)


def _policy(prior, rate: float, **kwargs) -> AdaptivePolicy:
    kwargs.setdefault("chunk_prior", 0.0)
    return AdaptivePolicy(PolicyConfig(step_prior=prior, prior_acceptance=rate, **kwargs))


def _plain_step(policy: AdaptivePolicy, rows: int, seconds: float) -> None:
    policy.record_step(StepSample(rows, 0, 0, seconds))


def _candidates(n: int, cap: int = 4) -> list[Candidate]:
    return [Candidate(f"s{i}", cap) for i in range(n)]


def test_no_drafts_before_the_engine_has_timed_a_step():
    policy = _policy(FLAT, 0.9)
    assert policy.plan(1, _candidates(1)).limits == {}


def test_cheap_rows_and_good_acceptance_draft_the_full_length():
    policy = _policy(((1, 1.0), (64, 1.1)), 0.8)  # memory bound: extra rows nearly free
    _plain_step(policy, 1, 0.030)
    plan = policy.plan(1, _candidates(1))
    assert plan.limits == {"s0": 4} and plan.predicted_speedup > 2


def test_compute_bound_batches_turn_speculation_off():
    policy = _policy(LINEAR, 0.8, chunk_prior=0.07)
    _plain_step(policy, 64, 0.640)
    plan = policy.plan(64, _candidates(64))
    assert plan.limits == {} and plan.shadows == () and plan.predicted_speedup == 1.0


def test_caps_and_max_draft_bound_each_sequence():
    policy = _policy(FLAT, 0.9, max_draft=3, chunk_prior=0.07)
    _plain_step(policy, 2, 0.030)
    plan = policy.plan(2, [Candidate("a", 1), Candidate("b", 8)])
    assert plan.limits == {"a": 1, "b": 3}


def test_drafts_go_to_the_sequences_that_accept_them():
    policy = _policy(((1, 1.0), (8, 1.0), (16, 1.6), (48, 4.0)), 0.5, min_gain=0.0)
    _plain_step(policy, 8, 0.080)
    for _ in range(10):
        for i in range(8):
            policy.record_verify(f"s{i}", 4, 4 if i < 2 else 0)  # s0, s1 accept everything
    limits = policy.plan(8, _candidates(8)).limits
    assert limits == {"s0": 4, "s1": 4}


@pytest.mark.parametrize(("chunk_prior", "drafting"), [(0.0, {"a", "b"}), (0.5, {"a"})])
def test_a_costly_chunk_leaves_it_to_the_sequences_with_most_to_gain(chunk_prior, drafting):
    policy = _policy(FLAT, 0.5, global_weight=1e-9, chunk_prior=chunk_prior)
    _plain_step(policy, 2, 0.020)
    for _ in range(20):
        policy.record_verify("a", 4, 4)  # a accepts everything, b is at the prior 0.5
    assert set(policy.plan(2, [Candidate("a", 4), Candidate("b", 4)]).limits) == drafting


def test_drafting_cost_counts_against_the_drafts():
    policy = _policy(FLAT, 0.5)
    _plain_step(policy, 1, 0.030)
    assert policy.plan(1, _candidates(1)).limits  # free rows: worth drafting
    policy.record_step(StepSample(1, 4, 1, 0.030, 4, 0.200))  # but drafting 4 took 200 ms
    assert policy.plan(1, _candidates(1)).limits == {}


def test_the_gain_check_vetoes_only_drafting_that_lost_against_plain_steps():
    check = GainCheck(window=3, min_steps=2)
    # batch 10, plain 1 s: 10 tok/s; predicted 20 tokens in 1 s; came 15 tokens in 1 s
    check.record(10, 1.0, (20.0, 1.0), (15.0, 1.0))
    assert check.factor() == 1.0  # one step: not yet
    check.record(10, 1.0, (20.0, 1.0), (15.0, 1.0))
    assert check.factor() == 1.0  # short of the prediction, but a gain: left alone
    check.record(10, 1.0, (20.0, 1.0), (9.0, 2.0))  # a loss: 4.5 tok/s
    # the window (3 steps): 39 tokens in 4 s against plain 10 tok/s -> predicted 60 in 3 s
    assert check.factor() == pytest.approx((39 / 4) / (60 / 3))
    for _ in range(3):
        check.record(10, 1.0, (20.0, 1.0), (30.0, 1.0))  # gains again: the old steps age out
    assert check.factor() == 1.0


def _drafting_steps(policy: AdaptivePolicy, accepted: int) -> list[dict[str, int]]:
    """Four steps of one sequence the tracker rates at 0.9 whose drafts (as the tracker
    learns nothing: huge shrink) are `accepted`: with none accepted, each step twice as long
    as a plain one (a loss), else as long (a gain)."""
    plans = []
    for _ in range(4):
        plans.append(policy.plan(1, [Candidate("a", 4)]).limits)
        policy.record_verify("a", 4, accepted)
        policy.record_step(StepSample(1, 4, 1, 0.030 if accepted else 0.060, 4, 0.0))
    return plans


@pytest.mark.parametrize(("accepted", "drafting_after"), [(0, False), (4, True)])
def test_drafting_stops_at_a_batch_whose_steps_realise_less_than_predicted(
    accepted, drafting_after
):
    policy = _policy(FLAT, 0.9, global_weight=1e-9, seq_shrink=1e6, gain_min_steps=4)
    _plain_step(policy, 1, 0.030)
    _plain_step(policy, 8, 0.030)
    assert _drafting_steps(policy, accepted) == [{"a": 4}] * 4  # the model alone: draft
    assert bool(policy.plan(1, [Candidate("a", 4)]).limits) is drafting_after
    assert policy.plan(8, _candidates(8)).limits  # another batch keeps its own record


def test_sequences_not_drafting_get_shadow_drafts_longest_unobserved_first():
    prior = ((1, 1.0), (4, 1.2), (8, 1.3), (64, 50.0))
    policy = _policy(prior, 0.01, shadows_per_pass=2, shadow_every=2)
    _plain_step(policy, 4, 0.040)
    plans = [policy.plan(4, _candidates(4)) for _ in range(6)]
    assert [p.limits for p in plans] == [{}] * 6
    # no drafts: a pass for sequences never seen, then one every other step
    assert [p.shadows for p in plans] == [
        ("s0", "s1"),
        ("s2", "s3"),
        (),
        ("s0", "s1"),
        (),
        ("s2", "s3"),
    ]


def test_no_shadows_where_even_good_drafts_could_not_pay():
    policy = _policy(LINEAR, 0.01, chunk_prior=0.5)
    _plain_step(policy, 64, 0.640)
    assert policy.plan(64, _candidates(64)).shadows == ()


def test_a_batch_not_measured_itself_or_long_without_a_plain_step_runs_plain():
    policy = _policy(FLAT, 0.9, plain_every=3)
    _plain_step(policy, 1, 0.030)
    assert policy.plan(2, _candidates(2)).limits == {}  # batch 2: would be extrapolated
    _plain_step(policy, 4, 0.030)
    # between measured batches 1 and 4 but not measured itself: a step's seconds need not be
    # monotone in its rows, so batch 2's baseline is measured before it drafts
    assert policy.plan(2, _candidates(2)).limits == {}
    _plain_step(policy, 2, 0.030)
    assert policy.plan(2, _candidates(2)).limits
    limits = [bool(policy.plan(1, _candidates(1)).limits) for _ in range(5)]
    assert limits == [True, True, True, False, False]  # 3 steps at batch 1: plain until one
    _plain_step(policy, 1, 0.030)
    assert policy.plan(1, _candidates(1)).limits


def test_fixed_policy_always_drafts_the_full_length():
    plan = FixedPolicy(4).plan(64, [Candidate("a", 2), Candidate("b", 9), Candidate("c", 0)])
    assert plan.limits == {"a": 2, "b": 4}


def test_policy_and_cost_import_without_torch():
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvmesh.engine.spec.policy, kvmesh.engine.spec.cost\n"
        "assert 'numpy' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name, kind", [("adaptive", AdaptivePolicy), ("fixed", FixedPolicy)])
def test_the_engine_config_chooses_the_policy(name, kind):
    from kvmesh.config import EngineConfig
    from kvmesh.engine.spec.speculator import build_speculator

    config = EngineConfig.of(
        model="smollm2-135m", speculative="ngram", num_speculative_tokens=3, speculative_policy=name
    )
    speculator = build_speculator(config, "smollm2-135m", model=None, max_model_len=64)
    assert isinstance(speculator.policy, kind)
    assert speculator.policy.plan(1, [Candidate("a", 9)]).limits in ({}, {"a": 3})


def test_an_unknown_policy_is_a_clear_error():
    from kvmesh.config import EngineConfig
    from kvmesh.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="speculative_policy must be one of"):
        EngineConfig.of(model="smollm2-135m", speculative_policy="greedy")


def test_the_drafting_seconds_are_charged_to_every_token_drafted_shadows_included():
    from kvmesh.engine.core.sampling_params import SamplingParams
    from kvmesh.engine.core.sequence import Sequence
    from kvmesh.engine.spec.policy import DraftPlan
    from kvmesh.engine.spec.speculator import Speculator

    class Planned(FixedPolicy):  # two drafts for "a", a shadow draft for "b"
        samples: list = []

        def plan(self, batch, candidates):
            return DraftPlan({"a": 2}, ("b",))

        def record_step(self, sample):
            self.samples.append(sample)

    from kvmesh.engine.spec.proposer import BlindProposer

    class Drafts(BlindProposer):
        def propose(self, seq, limit):
            return [7, 8, 9][:limit]

        def release(self, seq_ids, force=False):
            pass

    seqs = []
    for name in "ab":
        seq = Sequence(name, [1, 2, 3], SamplingParams(max_tokens=16))
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    policy = Planned(4)
    speculator = Speculator(Drafts(), 4, 64, policy)
    speculator.propose(seqs)
    assert seqs[0].draft_token_ids == [7, 8] and seqs[1].draft_token_ids == []

    class Chunk:
        def __init__(self, seq, draft):
            self.seq, self.draft, self.num_tokens, self.start = seq, draft, 1, seq.num_tokens - 1

    class Runner:
        features = None

    speculator.observe([Chunk(seqs[0], [7, 8]), Chunk(seqs[1], [])], Runner())
    (sample,) = policy.samples
    assert (sample.batch, sample.drafts, sample.chunks, sample.proposed) == (2, 2, 1, 3)
