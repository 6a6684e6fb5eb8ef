"""What the scheduler is configured with and what one step of it produces (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.core.step import ChunkPlan, StepPlan


@dataclass(frozen=True)
class SchedulerLimits:
    """Per-step limits: sequences in flight, tokens per forward pass, context length (the
    engine builds them from its config's scheduler section and the model's context)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must leave room for a prompt token and an output")


@dataclass(slots=True)  # built per sequence per step: not frozen (slower to build); never mutated
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of seq run this step; `sample` when they reach the end."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool
    draft: tuple[int, ...] = ()  # speculative tokens after seq's last token (to verify)

    @property
    def plan(self) -> ChunkPlan:
        return ChunkPlan(self.seq.seq_id, self.start, self.num_tokens, self.sample, self.draft)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work: `step` is what the model runner gets (plain data); `chunks` are the
    same chunks with their live sequences, for the engine's own bookkeeping; and the ids
    preempted while planning it."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int
    step: StepPlan

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def without(self, seq_ids: set[str]) -> SchedulerOutput:
        """The same step with these sequences' chunks dropped (e.g. failed their check)."""
        chunks = tuple(c for c in self.chunks if c.seq.seq_id not in seq_ids)
        plans = tuple(c for c in self.step.chunks if c.req_id not in seq_ids)
        return replace(self, chunks=chunks, step=replace(self.step, chunks=plans))
