"""Continuous batching with chunked prefill (vLLM v1 style, pure Python).

Each step has one token budget shared by running sequences (decodes and unfinished prefills,
in order) and then newly admitted ones (FIFO). When pages run out the last running sequence
is preempted by recompute: its pages are freed and it goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from kvmesh.engine.core.scheduled import ScheduledChunk, SchedulerLimits, SchedulerOutput
from kvmesh.engine.core.sequence import FinishReason, SeqStatus, Sequence
from kvmesh.engine.core.step import StepDiffer
from kvmesh.engine.kv.block_manager import BlockManager

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerLimits", "SchedulerOutput"]
from kvmesh.errors import CapacityError, ContextLengthError


class Scheduler:
    """Decides which tokens of which sequences run each step; owns the waiting/running queues."""

    def __init__(
        self,
        config: SchedulerLimits,
        block_manager: BlockManager,
        eos_token_ids: frozenset[int],
        on_retire: Callable[[Sequence, FinishReason], bool] | None = None,
    ) -> None:
        """`on_retire`: called with each sequence that finishes or is aborted, before its pages
        are freed; True when the caller keeps them (a hand-over holds a keep_pages request's)."""
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}
        self.differ = StepDiffer()  # what the runner knows of each request
        self._on_retire = on_retire

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; reject one that could never run."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"duplicate seq_id {seq.seq_id!r}")
        if seq.num_tokens >= self.config.max_model_len:
            raise ContextLengthError(
                f"prompt has {seq.num_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}, which leaves no room for output"
            )
        pool = self.block_manager.config
        needed = self.block_manager.pages_needed(seq.num_tokens + 1)
        if needed > pool.num_pages:
            raise CapacityError(
                f"prompt of {seq.num_tokens} tokens needs {needed} KV pages of "
                f"{pool.page_size} tokens, but the pool only has {pool.num_pages}"
            )
        seq.status = SeqStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, first_token: int) -> FinishReason | None:
        """Join a sequence whose prompt KV another worker wrote into its (allocated) pages.

        Returns the finish reason when the first token already ends it (pages freed then).
        With max_num_seqs running it waits first in line, holding its pages.
        """
        seq.num_computed_tokens = seq.num_tokens  # the prompt (and any resumed tokens)
        self.block_manager.cache_full_pages(seq, seq.num_computed_tokens)
        seq.append_token(first_token)
        self._seqs[seq.seq_id] = seq
        reason = self._stop_reason(seq, first_token)
        if reason is not None:
            self._retire(seq, reason)
            return reason
        if len(self.running) < self.config.max_num_seqs:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
        return None

    def token_loads(self) -> tuple[int, int]:
        """(prompt tokens still to compute, tokens of the running sequences): what a worker
        reports as its load (GetLoads) and the router balances on."""
        seqs = [*self.running, *self.waiting]
        queued = sum(max(s.num_prompt_tokens - s.num_computed_tokens, 0) for s in seqs)
        return queued, sum(s.num_tokens for s in self.running)

    def abort(self, seq_id: str) -> Sequence | None:
        """Stop a waiting or running sequence and free its pages; None if unknown or done."""
        return self.finish(seq_id, FinishReason.ABORT)

    def finish(self, seq_id: str, reason: FinishReason) -> Sequence | None:
        """Finish a sequence from outside (e.g. a stop string matched); None if unknown."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._retire(seq, reason)
        return seq

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running sequences first, then admit waiting ones while room remains."""
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, chunks, preempted)
        if not preempted:  # as vLLM v1: no admissions in a step that had to preempt
            budget = self._schedule_waiting(budget, chunks)
        step = self.differ.plan(
            [(c.seq.seq_id, c.seq.token_ids, c.seq.block_table, c.seq.page_tags) for c in chunks],
            tuple([c.plan for c in chunks]),
        )
        used = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(tuple(chunks), tuple(preempted), used, step)

    def _schedule_running(
        self, budget: int, chunks: list[ScheduledChunk], preempted: list[str]
    ) -> int:
        page_size = self.block_manager.config.page_size
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            start = seq.num_computed_tokens
            left = len(seq.token_ids) - start
            if left == 1 and not seq.draft_token_ids and start < len(seq.block_table) * page_size:
                # most rows of most steps: one token to decode, its page already held
                chunks.append(ScheduledChunk(seq, start, 1, seq.finalizing is None))
                budget -= 1
                index += 1
                continue
            num_tokens = min(left, budget)
            if num_tokens <= 0:  # nothing left to compute (update() not applied yet)
                index += 1
                continue
            draft = self._draft(seq, num_tokens, budget)
            if draft and not self.block_manager.allocate(seq, 1 + len(draft)):
                draft = ()  # no room to speculate: plain decode (may still preempt below)
            while not draft and not self.block_manager.allocate(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    return budget
            chunks.append(self._chunk(seq, num_tokens, draft))
            budget -= num_tokens + len(draft)
            index += 1
        return budget

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prefix = None if seq.block_table else self.block_manager.match_prefix(seq)
            done = seq.num_computed_tokens if prefix is None else prefix.num_tokens
            num_tokens = min(seq.num_tokens - done, budget)  # prefilled elsewhere: done > 0
            if not self.block_manager.allocate(seq, num_tokens, prefix):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_tokens))
            budget -= num_tokens
        return budget

    @staticmethod
    def _draft(seq: Sequence, num_tokens: int, budget: int) -> tuple[int, ...]:
        """The drafts to verify this step: only for a plain decode step, within the budget."""
        if num_tokens != 1 or seq.finalizing is not None or not seq.draft_token_ids:
            return ()
        return tuple(seq.draft_token_ids[: max(budget - 1, 0)])

    @staticmethod
    def _chunk(seq: Sequence, num_tokens: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        start = seq.num_computed_tokens
        sample = start + num_tokens == seq.num_tokens and seq.finalizing is None
        return ScheduledChunk(seq, start, num_tokens, sample, draft)

    def recompute(self, seq_id: str) -> None:
        """Drop a sequence's KV and compute it again from its tokens (a page failed its
        integrity tag): its pages are freed and it waits first in line, as a preempted one."""
        seq = self._seqs[seq_id]
        (self.running if seq.status is SeqStatus.RUNNING else self.waiting).remove(seq)
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.differ.forget(seq.seq_id)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def update(self, output: SchedulerOutput, sampled: Mapping[str, list[int]]) -> list[Sequence]:
        """Apply a step's results: advance KV progress, append samples, retire finished seqs.

        A chunk with drafts emits 1..k+1 tokens: the accepted drafts and one of the target's;
        tokens after a stop are dropped. KV stays valid for the last token and the accepted
        drafts only; pages past what the sequence now needs go back to the pool.
        """
        finished: list[Sequence] = []
        page_size = self.block_manager.config.page_size
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is SeqStatus.FINISHED:
                continue  # aborted or finished from outside since schedule()
            if not chunk.sample:
                seq.num_computed_tokens += chunk.num_tokens
                self.block_manager.cache_full_pages(seq, seq.num_computed_tokens)
                if seq.finalizing is not None and seq.num_computed_tokens == seq.num_tokens:
                    self.running.remove(seq)
                    self._retire(seq, seq.finalizing)  # reported finished a step ago
                continue
            tokens = sampled[seq.seq_id]
            if len(tokens) == 1:  # most rows: one token appended
                seq.token_ids.append(tokens[0])
                reason = self._stop_reason(seq, tokens[0])
                computed = seq.num_computed_tokens = seq.num_computed_tokens + chunk.num_tokens
                # one more token computed fills a page only at a page boundary
                if chunk.num_tokens != 1 or computed % page_size == 0:
                    self.block_manager.cache_full_pages(seq, computed)
            else:
                reason, emitted = self._append(seq, tokens)
                tokens[emitted:] = []  # what the caller reports: up to the stop
                seq.num_computed_tokens += chunk.num_tokens - 1 + emitted
                self.block_manager.cache_full_pages(seq, seq.num_computed_tokens)
            if chunk.draft:
                self.block_manager.trim(seq, seq.num_tokens)
            if reason is not None:
                finished.append(seq)
                if self._finalize(seq, reason):
                    continue
                self.running.remove(seq)
                self._retire(seq, reason)
        return finished

    def _append(self, seq: Sequence, tokens: list[int]) -> tuple[FinishReason | None, int]:
        """Append tokens until one stops the sequence: (reason, tokens appended)."""
        for count, token_id in enumerate(tokens, start=1):
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                return reason, count
        return None, len(tokens)

    def _finalize(self, seq: Sequence, reason: FinishReason) -> bool:
        """A finished sequence whose last token completes a page stays one more (non-sampling)
        step so that page's KV is computed and cached: the next turn of a conversation then hits
        the whole history. The finish is reported now; the pages are freed after that step."""
        page_size = self.block_manager.config.page_size
        if (
            seq.keep_pages
            or not self.block_manager.config.enable_prefix_caching
            or seq.num_tokens % page_size
        ):
            return False
        seq.finalizing = seq.finish_reason = reason
        return True

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if token_id in params.stop_token_ids or (
            token_id in self.eos_token_ids and not params.ignore_eos
        ):
            return FinishReason.STOP
        num_tokens = len(seq.token_ids)
        if (
            num_tokens - len(seq.prompt_token_ids) >= params.max_tokens
            or num_tokens >= self.config.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        self.differ.forget(seq.seq_id)
        if self._on_retire is None or not self._on_retire(seq, reason):
            self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
