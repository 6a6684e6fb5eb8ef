"""The engine's side of speculative decoding: before a step, ask the policy how many drafts each
sequence verifies and the proposer for them; after it (engine/runner/sample_step.py turns the step's
logits into emitted tokens), hand the policy what the step measured (its rows and seconds, the
drafting seconds, each verification's acceptance)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import structlog
import torch

from kvmesh.engine.core.scheduler import ScheduledChunk
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.models import CausalLM
from kvmesh.engine.runner.runner import ModelRunner
from kvmesh.engine.spec.cost import StepSample
from kvmesh.engine.spec.policy import (
    AdaptivePolicy,
    Candidate,
    DraftPlan,
    DraftPolicy,
    FixedPolicy,
    PolicyConfig,
)
from kvmesh.engine.spec.proposer import DraftSource, Proposer
from kvmesh.engine.spec.stats import SpecStats

log = structlog.get_logger(__name__)
LOG_EVERY = 512  # policy steps between two `spec.policy` log lines


@dataclass(frozen=True)
class _Mark:
    """When the step's model work began, and what drafting cost before it."""

    at: float
    drafted: int  # tokens proposed, shadow drafts included (the drafting seconds cover them)
    draft_s: float


def speculable(seq: Sequence) -> bool:
    """Sequences whose sampling does not depend on per-position history or need logprobs."""
    params = seq.params
    return params.logprobs is None and not params.needs_penalties


class Speculator:
    def __init__(
        self,
        proposer: Proposer,
        num_tokens: int,
        max_model_len: int,
        policy: DraftPolicy | None = None,
        listener: Callable[[int, int], None] | None = None,
        capture: tuple[int, ...] = (),
    ) -> None:
        """`listener`: each verification's (drafted, emitted), for metrics; `capture`: the
        target's layers whose outputs the proposer reads (EAGLE's features)."""
        self.capture = capture
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.policy: DraftPolicy = policy or AdaptivePolicy(PolicyConfig(max_draft=num_tokens))
        self.stats = SpecStats(on_verify=self._verified, listener=listener)
        self._mark: _Mark | None = None
        self._shadows: dict[str, int] = {}  # seq_id -> its shadow draft this step

    def _verified(self, seq_id: str, drafted: int, accepted: int) -> None:
        self.policy.record_verify(seq_id, drafted, accepted)

    def propose(self, running: Seq[Sequence]) -> None:
        """Set draft_token_ids on every running sequence (empty where it does not draft)."""
        candidates: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_token_ids = []
            decoding = seq.num_computed_tokens == seq.num_tokens - 1 and seq.finalizing is None
            if decoding and speculable(seq):
                remaining = seq.params.max_tokens - seq.num_output_tokens - 1
                room = self.max_model_len - seq.num_tokens - 1
                cap = min(self.num_tokens, remaining, room)
                if cap > 0:
                    candidates.append((seq, cap))
        drafted, started = 0, time.perf_counter()
        self._shadows = {}
        if candidates:
            plan = self.policy.plan(len(running), [Candidate(s.seq_id, c) for s, c in candidates])
            self._count(plan, len(running))
            shadows = set(plan.shadows)
            requests = [
                (s, plan.limits.get(s.seq_id) or 1)
                for s, _ in candidates
                if s.seq_id in plan.limits or s.seq_id in shadows
            ]
            for (seq, limit), draft in zip(requests, self._drafts(requests), strict=True):
                drafted += len(draft[:limit])  # what the drafting seconds paid for, shadows too
                if seq.seq_id in shadows:
                    if draft:
                        self._shadows[seq.seq_id] = draft[0]
                    continue
                seq.draft_token_ids = list(draft[:limit])
        now = time.perf_counter()
        self._mark = _Mark(now, drafted, now - started)

    def _drafts(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        if not requests:
            return []
        return self.proposer.propose_batch(requests)

    def _count(self, plan: DraftPlan, batch: int) -> None:
        stats = self.stats
        stats.count(plan)
        if stats.policy_steps % LOG_EVERY == 0:
            log.info(
                "spec.policy",
                steps=stats.policy_steps,
                off_steps=stats.off_steps,
                shadow_drafts=stats.shadow_drafts,
                shadow_hits=stats.shadow_hits,
                drafts_per_step=_round(stats.drafts_per_step),
                accepted_per_draft=_round(stats.accepted_per_draft),
                acceptance=_round(self.policy.acceptance()),
                batch=batch,
                drafts_now=sum(plan.limits.values()),
                predicted_speedup=_round(plan.predicted_speedup),
            )

    def seed(self, seq: Sequence, fused: torch.Tensor, start: int) -> None:
        """Take over a prefill worker's draft window (fused features of positions start...)."""
        if len(fused):
            next_tokens = seq.token_ids[start + 1 : start + 1 + len(fused)]
            self.proposer.seed(seq.seq_id, fused, start, next_tokens)

    def hand_over(self, seq_id: str) -> tuple[torch.Tensor, int] | None:
        return self.proposer.hand_over(seq_id)

    def observe(self, chunks: Seq[ScheduledChunk], runner: ModelRunner) -> None:
        """After a step: hand the target's features of the newly committed positions to a
        proposer that reads them (EAGLE); a decode step's rows, chunks and seconds to the
        policy."""
        mark, self._mark = self._mark, None
        if mark is not None and all(chunk.num_tokens == 1 for chunk in chunks):
            drafts = sum(len(chunk.draft) for chunk in chunks)
            verifying = sum(bool(chunk.draft) for chunk in chunks)
            seconds = time.perf_counter() - mark.at
            self.policy.record_step(
                StepSample(len(chunks), drafts, verifying, seconds, mark.drafted, mark.draft_s)
            )
        if self._shadows:
            self._score_shadows(chunks)
        if not self.proposer.reads_features or runner.features is None:
            return
        features = runner.features.clone()  # one copy per step; a proposer may keep its rows
        for chunk in chunks:
            seq = chunk.seq
            count = seq.num_computed_tokens - chunk.start
            if count <= 0 or seq.seq_id not in runner.rows_of:
                continue
            if seq.keep_pages:
                self.proposer.hold(seq.seq_id)
            begin, _ = runner.rows_of[seq.seq_id]
            next_tokens = seq.token_ids[chunk.start + 1 : chunk.start + 1 + count]
            self.proposer.observe(
                seq.seq_id, features[begin : begin + count], next_tokens, chunk.start
            )

    def _score_shadows(self, chunks: Seq[ScheduledChunk]) -> None:
        """Each shadow draft against the token the target emitted after the same position."""
        for chunk in chunks:
            seq = chunk.seq
            shadow = self._shadows.get(seq.seq_id)
            if shadow is None or len(seq.token_ids) <= chunk.start + 1:
                continue
            hit = seq.token_ids[chunk.start + 1] == shadow
            self.stats.shadow_drafts += 1
            self.stats.shadow_hits += hit
            self.policy.record_verify(seq.seq_id, 1, int(hit))
        self._shadows = {}

    def release(self, seq_ids: Iterable[str], force: bool = False) -> None:
        ids = list(seq_ids)
        self.proposer.release(ids, force)
        self.policy.forget(ids)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def build_speculator(
    config,
    model_name: str,
    model: CausalLM,
    max_model_len: int,
    draft: DraftSource | None = None,
    listener: Callable[[int, int], None] | None = None,
) -> Speculator | None:
    """The engine's speculator for `config.spec.speculative` (None: no speculation); EAGLE drafts
    come from `draft` where one is given, else from a head loaded in process. Its `capture`:
    the target's layers whose outputs the runner keeps for the drafts."""
    if config.spec.speculative == "none":
        return None
    if config.spec.speculative == "ngram":
        from kvmesh.engine.spec.ngram import NgramProposer

        proposer: Proposer = NgramProposer(config.spec.num_speculative_tokens)
        capture: tuple[int, ...] = ()
    elif draft is not None:
        capture = tuple(draft.check_target(model_name))
        proposer = draft
    else:
        from kvmesh.engine.spec.eagle import load_head
        from kvmesh.engine.spec.eagle_proposer import EagleProposer

        head = load_head(config.spec.draft_model, model_name)
        capture = tuple(head.config.capture_layers)
        proposer = EagleProposer(head, model.token_embeddings)
    k = config.spec.num_speculative_tokens
    policy = FixedPolicy(k) if config.spec.speculative_policy == "fixed" else None
    return Speculator(proposer, k, max_model_len, policy, listener, capture)
