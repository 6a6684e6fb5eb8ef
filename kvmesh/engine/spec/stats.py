"""What speculation did: verified drafts and their acceptance, the policy's steps (drafting or
off), shadow drafts; listeners for metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.engine.spec.policy import DraftPlan


@dataclass
class SpecStats:
    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0  # drafts the target agreed with
    steps: int = 0  # verification steps (sequence x step)
    accept_lengths: Counter[int] = field(default_factory=Counter)  # tokens emitted per step
    policy_steps: int = 0  # engine steps with a sequence that could draft
    off_steps: int = 0  # ... of which the policy drafted for none
    shadow_drafts: int = 0  # one-token drafts compared with the target's token, not verified
    shadow_hits: int = 0  # ... that the target's token matched
    listener: Callable[[int, int], None] | None = None  # (drafted, emitted) per verification
    plan_listener: Callable[[DraftPlan], None] | None = None  # each step's plan (metrics)
    on_verify: Callable[[str, int, int], None] | None = None  # (seq_id, drafted, accepted)

    @property
    def mean_emitted(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the target's token)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def accepted_per_draft(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def drafts_per_step(self) -> float | None:
        """Draft tokens verified per engine step that could draft."""
        return self.draft_tokens / self.policy_steps if self.policy_steps else None

    def record(self, seq_id: str, drafted: int, emitted: int) -> None:
        """One sequence's verification of `drafted` drafts that emitted `emitted` tokens."""
        self.steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += emitted - 1
        self.accept_lengths[emitted] += 1
        if self.listener is not None:
            self.listener(drafted, emitted)
        if self.on_verify is not None:
            self.on_verify(seq_id, drafted, emitted - 1)

    def count(self, plan: DraftPlan) -> None:
        self.policy_steps += 1
        self.off_steps += not plan.limits
        if self.plan_listener is not None:
            self.plan_listener(plan)
