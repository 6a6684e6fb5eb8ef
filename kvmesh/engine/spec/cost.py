"""Measured costs for the speculation policy (pure Python): seconds of a decode step as a
function of its rows and verification chunks, and seconds of drafting by tokens drafted.

A curve starts from a prior shape (relative seconds by rows, measured once on a reference
machine) and is rescaled by what this engine measures: each bucket of rows keeps its latest
samples and their median (robust to a neighbour's burst on a shared machine); a rows count
between measured buckets takes the measured/prior ratio interpolated between them, so
measurements set the level and the prior only the shape where nothing was measured yet.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

EXACT_BUCKETS = 16  # rows up to this many have a bucket each; above, 4 buckets per doubling


def bucket(rows: int) -> int:
    """The bucket (its centre, in rows) a rows count falls in."""
    if rows <= EXACT_BUCKETS:
        return rows
    return round(EXACT_BUCKETS * 2 ** (round(4 * math.log2(rows / EXACT_BUCKETS)) / 4))


class PriorCurve:
    """Relative seconds by rows: piecewise linear through `points` (rows ascending), flat below
    the first point, extended by the last segment's slope above the last."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        if len(points) < 2 or any(b[0] <= a[0] for a, b in itertools.pairwise(points)):
            raise ValueError("a prior curve needs >= 2 points with ascending rows")
        if any(value <= 0 for _, value in points):
            raise ValueError("a prior curve's values must be > 0")
        self._rows = [float(r) for r, _ in points]
        self._values = [v for _, v in points]

    def __call__(self, rows: float) -> float:
        xs, ys = self._rows, self._values
        if rows <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_right(xs, rows), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)


class CostCurve:
    """Seconds by rows, from measurements (`record`) over a prior shape (`estimate`)."""

    def __init__(self, prior: PriorCurve, window: int = 16) -> None:
        self.prior = prior
        self.window = window
        self._samples: dict[int, deque[float]] = {}
        self._centres: list[int] = []  # measured buckets, ascending
        self._ratio: dict[int, float] = {}  # bucket -> median seconds / prior(bucket)

    def record(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        key = bucket(rows)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=self.window)
            bisect.insort(self._centres, key)
        samples.append(seconds)
        self._ratio[key] = statistics.median(samples) / self.prior(key)

    def measured(self, rows: int) -> bool:
        """Whether the bucket of `rows` has samples of its own."""
        return bucket(rows) in self._samples

    def estimate(self, rows: float) -> float | None:
        """Predicted seconds for `rows` (None before any measurement)."""
        centres = self._centres
        if not centres:
            return None
        i = bisect.bisect_left(centres, rows)
        if i < len(centres) and centres[i] == rows:
            ratio = self._ratio[centres[i]]
        elif i == 0:
            ratio = self._ratio[centres[0]]
        elif i == len(centres):
            ratio = self._ratio[centres[-1]]
        else:
            lo, hi = centres[i - 1], centres[i]
            ratio = self._ratio[lo] + (self._ratio[hi] - self._ratio[lo]) * (rows - lo) / (hi - lo)
        return ratio * self.prior(rows)


DRAFT_PRIOR = ((1, 1.0), (2, 2.0))  # drafting seconds proportional to tokens until measured


@dataclass(frozen=True)
class StepSample:
    """What one decode step cost (steps with prompt chunks are not sampled)."""

    batch: int  # decoding sequences
    drafts: int  # draft rows verified
    chunks: int  # sequences that verified drafts
    seconds: float  # the step without drafting
    proposed: int = 0  # draft tokens proposed for it
    draft_seconds: float = 0.0  # proposing them

    @property
    def rows(self) -> int:
        return self.batch + self.drafts


class SpecFit:
    """A batch's surplus of a step with drafts over its plain step, per verifying chunk, as a
    line in drafts per chunk: surplus / chunks = a + r * (drafts / chunks) -- a chunk's own
    cost (it runs with context, dearer than decode rows) and each draft row's. Theil-Sen
    (median of pairwise slopes, then median intercept): a neighbour's bursts on a shared
    machine move few samples. Until the samples spread in drafts per chunk, r is the prior."""

    def __init__(self, window: int) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (x, y)
        self._slope: float | None = None  # r, once the samples spread in x

    def record(self, chunks: int, drafts: int, surplus: float) -> None:
        self._samples.append((drafts / chunks, surplus / chunks))
        pairs = list(self._samples)
        slopes = [
            (y2 - y1) / (x2 - x1)
            for i, (x1, y1) in enumerate(pairs)
            for x2, y2 in pairs[i + 1 :]
            if abs(x2 - x1) >= 0.5
        ]
        self._slope = max(statistics.median(slopes), 0.0) if slopes else None

    def surplus(self, chunks: int, drafts: int, prior_row: float) -> float | None:
        """Predicted surplus seconds (None before any sample)."""
        if not self._samples:
            return None
        row = self._slope if self._slope is not None else prior_row
        chunk = statistics.median(y - row * x for x, y in self._samples)
        return max(chunk, 0.0) * chunks + row * drafts


class StepCosts:
    """Predicted seconds of a decode step of B rows: plain(B), plus for S drafts in c chunks a
    surplus fitted per batch bucket (SpecFit), plus drafting(S).

    Before a batch has run steps with drafts, the surplus is the plain curve's own slope per
    draft row plus `chunk_prior` one-row steps per chunk (on the torch backend a verifying
    sequence runs as a chunk with context, which costs more than its rows alone)."""

    def __init__(self, prior: PriorCurve, chunk_prior: float, window: int = 16) -> None:
        self.plain_curve = CostCurve(prior, window)
        self.draft_curve = CostCurve(PriorCurve(DRAFT_PRIOR), window)
        self.chunk_prior = chunk_prior  # chunk seconds / one-row step, until measured
        self.window = window
        self._fits: dict[int, SpecFit] = {}  # batch bucket -> fit

    def record(self, sample: StepSample) -> None:
        plain = self.plain_curve.estimate(sample.batch)
        if sample.chunks == 0:
            self.plain_curve.record(sample.batch, sample.seconds)
        elif plain is not None:
            fit = self._fits.setdefault(bucket(sample.batch), SpecFit(self.window))
            fit.record(sample.chunks, sample.drafts, max(sample.seconds - plain, 0.0))
        if sample.proposed:
            self.draft_curve.record(sample.proposed, sample.draft_seconds)

    def plain(self, rows: int) -> float | None:
        return self.plain_curve.estimate(rows)

    def step(self, batch: int, drafts: int, chunks: int) -> float:
        """Seconds of a step of `batch` decode rows plus `drafts` drafts in `chunks` chunks."""
        plain = self.plain_curve.estimate(batch) or 0.0
        if not drafts:
            return plain
        row = ((self.plain_curve.estimate(2 * batch) or 0.0) - plain) / batch
        fit = self._fits.get(bucket(batch))
        surplus = fit.surplus(chunks, drafts, row) if fit is not None else None
        if surplus is None:
            one_row = self.plain_curve.estimate(1) or 0.0
            surplus = row * drafts + self.chunk_prior * one_row * chunks
        return plain + surplus + (self.draft_curve.estimate(drafts) or 0.0)


class GainCheck:
    """A veto on drafting at one batch bucket once its drafting steps have lost: over the latest
    `window` drafting steps (at least `min_steps`), their tokens per second (accepted drafts
    counted, drafting seconds included) against plain steps' at the same batches; if below,
    the factor by which they fell short of the policy's predictions, which then scale every
    prediction at this bucket. Ratios of sums (a mean: accepted counts are skewed, a median
    under-rates drafts). Whatever the model misjudges -- a proposer whose later drafts fare
    worse than its first, rows dearer than the curve says -- shows up here; drafting that
    gains, if less than predicted, is left alone (a workload that drafts well next, JSON after
    chat, is not held back by it)."""

    def __init__(self, window: int, min_steps: int) -> None:
        self.min_steps = min_steps
        # (plain tokens, plain s, predicted tokens, predicted s, tokens, s) per drafting step
        self._steps: deque[tuple[float, ...]] = deque(maxlen=window)

    def record(
        self,
        batch: int,
        plain_s: float,
        predicted: tuple[float, float],
        realised: tuple[float, float],
    ) -> None:
        """One drafting step: its batch and the plain step's seconds there, and (tokens,
        seconds) as predicted and as they came."""
        if min(plain_s, predicted[1], realised[1]) > 0:
            self._steps.append((batch, plain_s, *predicted, *realised))

    def factor(self) -> float:
        """Realised over predicted tokens per second where drafting lost, else 1."""
        if len(self._steps) < self.min_steps:
            return 1.0
        batch, plain_s, p_tokens, p_s, tokens, seconds = (
            sum(column) for column in zip(*self._steps, strict=True)
        )
        if tokens / seconds >= batch / plain_s:
            return 1.0
        return min(1.0, (tokens / seconds) / (p_tokens / p_s))
