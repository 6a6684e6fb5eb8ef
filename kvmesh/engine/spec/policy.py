"""How many drafts each running sequence verifies this step (pure Python, no torch).

Model: drafts are accepted as a prefix, each with probability `a` given the previous one was
(greedy or rejection sampling alike), so a sequence's j-th draft is worth a**j tokens. A
decode step of B rows with S drafts in c verifying sequences costs plain(B) + surplus(S, c) +
draft(S) seconds, all measured by this engine (cost.py).

The policy maximises predicted tokens per second (a ratio, solved Dinkelbach-style): at the
current price -- tokens per second of the best plan so far, starting from the plain step --
each sequence independently drafts the k whose tokens a + ... + a**k beat what the price buys
in the k rows and the chunk they cost; the plan's own rate becomes the next price. Nothing is
drafted unless the plan beats the plain step by `min_gain`. At batch 1 a row costs little and
modest acceptance pays; at large batch the step is compute bound and speculation turns off.

What it learns from: every verification; what drafting steps realised (spec/cost.py GainCheck:
at a batch where they lost against plain steps, predictions are scaled by how far they fell
short); a plain step at each batch now and then (so the baseline it compares with is measured,
not inferred); and shadow drafts -- a sequence that
does not draft this step gets one draft that is never verified, only compared with the token
the target then emits (the same event as its acceptance, greedy or sampled), so a sequence
or workload whose acceptance rises is noticed at no cost to the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.engine.spec.cost import GainCheck, PriorCurve, StepCosts, StepSample, bucket

# Decode step seconds by rows, relative to one row: SmolLM2-135M fp32, torch backend, profiled
# once (`kvmesh bench spec --cost-profile`; above 64 rows inferred from verification steps; see
# docs/benchmarks-history.md, "Adaptive speculation"). Only the shape matters: the engine's own
# steps set the level, and replace it wherever it has run such steps.
STEP_PRIOR = (
    (1, 1.0),
    (2, 1.07),
    (3, 1.13),
    (5, 1.55),
    (8, 2.1),
    (16, 2.6),
    (32, 3.3),
    (64, 4.3),
    (128, 6.5),
    (320, 13.5),
)
CHUNK_PRIOR = 0.07  # a verifying sequence's surplus over its rows, in one-row steps (same run)
ROUNDS = 3  # price refinements per plan
ROW_PRICE_FACTORS = (1.0, 2.0, 4.0)  # row prices tried in each round, times the curve's slope


@dataclass(frozen=True)
class PolicyConfig:
    max_draft: int = 4  # drafts per sequence per step at most (--num-speculative-tokens)
    min_gain: float = 0.03  # draft only when predicted tokens/s beat the plain step by this
    prior_acceptance: float = 0.6  # per-draft acceptance assumed before any verification
    global_weight: float = 0.02  # EWMA weight of one verified draft in the engine-wide rate
    seq_memory: int = 24  # a sequence's own counts: about this many latest trials ...
    seq_shrink: float = 4.0  # ... plus this many pseudo-trials at the engine-wide rate
    shadows_per_pass: int = 8  # one-token shadow drafts, for sequences not drafting, ...
    shadow_every: int = 16  # ... every step that drafts, else one pass in this many steps
    shadow_ceiling: float = 0.9  # ... only where a sequence accepting this much would draft
    plain_every: int = 100  # a plain step at a batch whose last one is this many steps old
    step_prior: tuple[tuple[int, float], ...] = STEP_PRIOR
    chunk_prior: float = CHUNK_PRIOR
    samples_per_bucket: int = 16  # cost curves: the median of the latest samples per bucket
    gain_window: int = 32  # realised vs predicted gain: the latest drafting steps per bucket ...
    gain_min_steps: int = 4  # ... once this many

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")
        for name in ("prior_acceptance", "global_weight", "shadow_ceiling"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if min(self.min_gain, self.chunk_prior, self.seq_shrink, self.shadows_per_pass) < 0:
            raise ValueError("min_gain, chunk_prior, seq_shrink, shadows_per_pass must be >= 0")
        counts = (
            self.plain_every,
            self.samples_per_bucket,
            self.seq_memory,
            self.shadow_every,
            self.gain_window,
            self.gain_min_steps,
        )
        if min(counts) < 1:
            raise ValueError(
                "plain_every, samples_per_bucket, seq_memory, shadow_every, "
                "gain_window, gain_min_steps must be >= 1"
            )


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence that may draft, and at most how many tokens (tokens left, room)."""

    seq_id: str
    cap: int


@dataclass(frozen=True)
class DraftPlan:
    """Drafts to verify per sequence (absent: none); sequences to draft one token for without
    verifying it (shadows); predicted tokens/s over the plain step (None: not predicted)."""

    limits: dict[str, int]
    shadows: tuple[str, ...] = ()
    predicted_speedup: float | None = None


class DraftPolicy(Protocol):
    """Decides draft lengths before a step and learns from what the step measured."""

    def plan(self, batch: int, candidates: Sequence[Candidate]) -> DraftPlan: ...

    def record_verify(self, seq_id: str, drafted: int, accepted: int) -> None: ...

    def record_step(self, sample: StepSample) -> None: ...

    def forget(self, seq_ids: Iterable[str]) -> None: ...

    def acceptance(self) -> float | None: ...


class FixedPolicy:
    """The same number of drafts for every sequence, every step (speculation always on)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def plan(self, batch: int, candidates: Sequence[Candidate]) -> DraftPlan:
        return DraftPlan({c.seq_id: min(c.cap, self.num_tokens) for c in candidates if c.cap})

    def record_verify(self, seq_id: str, drafted: int, accepted: int) -> None:
        pass

    def record_step(self, sample: StepSample) -> None:
        pass

    def forget(self, seq_ids: Iterable[str]) -> None:
        pass

    def acceptance(self) -> float | None:
        return None


class AcceptanceTracker:
    """Per-draft acceptance: engine-wide an exponentially weighted rate; per sequence its own
    decayed counts shrunk toward the engine-wide rate, (accepted + n0 * overall) / (tried + n0),
    so a few rejections move a young sequence little. A verification of k drafts with `a`
    accepted is a accepted trials and, if a < k, one rejected (the rest were never tried)."""

    def __init__(self, prior: float, global_weight: float, memory: int, shrink: float) -> None:
        self.overall = prior
        self.global_weight, self.shrink = global_weight, shrink
        self._keep = 1.0 - 1.0 / memory  # a trial's weight after one more trial
        self._seqs: dict[str, tuple[float, float]] = {}  # seq_id -> (accepted, tried), decayed

    def rate(self, seq_id: str) -> float:
        own = self._seqs.get(seq_id)
        if own is None:
            return self.overall
        return (own[0] + self.shrink * self.overall) / (own[1] + self.shrink)

    def record(self, seq_id: str, drafted: int, accepted: int) -> None:
        trials = accepted + (accepted < drafted)
        if trials == 0:
            return
        old_accepted, old_tried = self._seqs.get(seq_id, (0.0, 0.0))
        keep = self._keep**trials
        self._seqs[seq_id] = (old_accepted * keep + accepted, old_tried * keep + trials)
        hit = accepted / trials
        self.overall += (1 - (1 - self.global_weight) ** trials) * (hit - self.overall)

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)


class AdaptivePolicy:
    """Draft lengths from measured acceptance and measured step costs (see the module doc)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.tracker = AcceptanceTracker(
            config.prior_acceptance, config.global_weight, config.seq_memory, config.seq_shrink
        )
        self.costs = StepCosts(
            PriorCurve(config.step_prior), config.chunk_prior, config.samples_per_bucket
        )
        self._step = 0
        self._since_plain: dict[int, int] = {}  # batch bucket -> its steps since a plain one
        self._seen_at: dict[str, int] = {}  # seq_id -> last step it drafted or shadowed
        self._last_total = 0  # drafts planned last step (where the row price is taken)
        self._gains: dict[int, GainCheck] = {}  # batch bucket -> realised vs predicted
        self._planned: dict[str, float] = {}  # this step's drafting sequences -> rate planned on
        self._verified = [0.0, 0]  # this step's verifications: predicted worth, drafts accepted

    def plan(self, batch: int, candidates: Sequence[Candidate]) -> DraftPlan:
        self._step += 1
        self._planned, self._verified = {}, [0.0, 0]
        usable = [c for c in candidates if c.cap > 0]
        base = self.costs.plain(batch)
        if not usable or base is None or self._plain_due(batch):
            return DraftPlan({})
        limits, speedup = self._choose(batch, base, usable)
        self._planned = {seq_id: self.tracker.rate(seq_id) for seq_id in limits}
        shadows = self._shadows(batch, base, usable, limits)
        for seq_id in (*limits, *shadows):
            self._seen_at[seq_id] = self._step
        self._last_total = sum(limits.values())
        return DraftPlan(limits, shadows, speedup)

    def _plain_due(self, batch: int) -> bool:
        """A plain step to measure the baseline: at a batch bucket not measured yet, or
        `plain_every` steps at this bucket after its latest plain step. Not interpolated:
        a step's seconds need not be monotone in its rows (MKL's fp32 linears were slower at
        some row counts than at the next larger ones: docs/benchmarks-history.md, "fp32 linears
        as weight @ x^T, and speculation baselines measured per batch"), and the veto
        (GainCheck) compares drafting steps with this baseline."""
        if not self.costs.plain_curve.measured(batch):
            return True
        key = bucket(batch)
        since = self._since_plain.get(key)
        self._since_plain[key] = (since or 0) + 1
        return since is not None and since >= self.config.plain_every

    def _choose(
        self, batch: int, base: float, usable: Sequence[Candidate]
    ) -> tuple[dict[str, int], float]:
        """The best plan found by refining the price, and its predicted speedup. The row price
        is the cost's slope at the last plan's drafts; the cost is not linear in rows, so each
        round also tries dearer rows (shorter drafts), every plan scored in full."""
        rates = [self.tracker.rate(c.seq_id) for c in usable]
        caps = [min(c.cap, self.config.max_draft) for c in usable]
        price, guess = batch / base, self._last_total or batch
        best: tuple[dict[str, int], float] = ({}, 1.0)
        for _ in range(ROUNDS):
            rows_s = self.costs.step(batch, guess, 0) - base
            row_s = rows_s / guess
            chunk_price = price * (self.costs.step(batch, guess, 1) - base - rows_s)
            found = None
            for dearer in ROW_PRICE_FACTORS:
                lengths = [
                    _length(r, cap, price * row_s * dearer, chunk_price)
                    for r, cap in zip(rates, caps, strict=True)
                ]
                total = sum(lengths)
                if total == 0:
                    break  # dearer rows only shorten plans further
                worth = sum(_worth(r, k) for r, k in zip(rates, lengths, strict=True))
                speedup = self._speedup(batch, base, total, sum(k > 0 for k in lengths), worth)
                if speedup > best[1]:
                    limits = {c.seq_id: k for c, k in zip(usable, lengths, strict=True) if k}
                    best, found = (limits, speedup), total
            if found is None:
                break
            price, guess = best[1] * batch / base, found
        if best[1] * self._gain(batch).factor() < 1.0 + self.config.min_gain:
            return {}, best[1]
        return best

    def _speedup(self, batch: int, base: float, drafts: int, chunks: int, worth: float) -> float:
        """Predicted tokens/s of a step with these drafts, over the plain step's."""
        return (batch + worth) / self.costs.step(batch, drafts, chunks) * base / batch

    def _shadows(
        self, batch: int, base: float, usable: Sequence[Candidate], limits: dict[str, int]
    ) -> tuple[str, ...]:
        """The sequences longest unobserved among those not drafting, if a sequence accepting
        `shadow_ceiling` of its drafts would draft at this batch (else nothing to learn). A
        step that drafts runs the proposer anyway; otherwise a pass is its own cost (the head's
        weights read once), so it comes every `shadow_every` steps, or for a new sequence."""
        count = self.config.shadows_per_pass
        idle = [c.seq_id for c in usable if c.seq_id not in limits]
        idle.sort(key=lambda seq_id: self._seen_at.get(seq_id, -1))
        due = limits or self._step % self.config.shadow_every == 0
        if not count or not idle or not (due or idle[0] not in self._seen_at):
            return ()
        if self._speedup(batch, base, 1, 1, self.config.shadow_ceiling) < 1:
            return ()
        return tuple(idle[:count])

    def _gain(self, batch: int) -> GainCheck:
        key = bucket(batch)
        check = self._gains.get(key)
        if check is None:
            check = self._gains[key] = GainCheck(
                self.config.gain_window, self.config.gain_min_steps
            )
        return check

    def record_verify(self, seq_id: str, drafted: int, accepted: int) -> None:
        rate = self._planned.get(seq_id)
        if rate is not None:  # a planned draft verified (not a shadow): what was expected of it
            self._verified[0] += _worth(rate, drafted)
            self._verified[1] += accepted
        self.tracker.record(seq_id, drafted, accepted)

    def record_step(self, sample: StepSample) -> None:
        plain_s = self.costs.plain(sample.batch)
        if sample.chunks and self._planned and plain_s is not None:
            batch, (worth, accepted) = sample.batch, self._verified
            predicted = (batch + worth, self.costs.step(batch, sample.drafts, sample.chunks))
            realised = (batch + accepted, sample.seconds + sample.draft_seconds)
            self._gain(batch).record(batch, plain_s, predicted, realised)
        self._planned, self._verified = {}, [0.0, 0]
        self.costs.record(sample)
        if sample.chunks == 0:
            self._since_plain[bucket(sample.batch)] = 0

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self.tracker.forget(seq_id)
            self._seen_at.pop(seq_id, None)

    def acceptance(self) -> float | None:
        return self.tracker.overall


def _length(rate: float, cap: int, row_price: float, chunk_price: float) -> int:
    """The k <= cap maximising rate + ... + rate**k - k * row_price - chunk_price (0: none
    pays). Terms fall with k, so k is the count of those above the row price."""
    k, gain, term = 0, 0.0, rate
    while k < cap and term > row_price:
        k, gain, term = k + 1, gain + term - row_price, term * rate
    return k if gain > chunk_price else 0


def _worth(rate: float, k: int) -> float:
    """Expected accepted tokens of k drafts: rate + rate**2 + ... + rate**k."""
    return sum(rate**j for j in range(1, k + 1))
