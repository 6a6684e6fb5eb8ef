"""The engine's side of speculative decoding: ask the proposer for drafts before a step, turn
the step's logits into emitted tokens (plain rows sampled as a batch, draft rows verified), and
keep acceptance statistics."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvmesh.engine.runner import ModelRunner, StepResult
from kvmesh.engine.sampler import Sampler, TokenLogprob
from kvmesh.engine.scheduler import ScheduledChunk
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec.verify import verify_greedy, verify_sampled


class Proposer(Protocol):
    """Drafts tokens. Optional: `observe(seq_id, features, next_tokens, start)` to read the
    target's features, `seed(seq_id, fused, start, next_tokens)` for a prefill hand-over,
    `propose_batch(requests)` to draft for a whole batch in one go."""

    def propose(self, seq: Sequence, limit: int) -> list[int]: ...

    def release(self, seq_ids: Iterable[str], force: bool = False) -> None: ...


@dataclass
class SpecStats:
    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0  # drafts the target agreed with
    steps: int = 0  # verification steps (sequence x step)
    accept_lengths: Counter[int] = field(default_factory=Counter)  # tokens emitted per step
    listener: Callable[[int, int], None] | None = None  # (drafted, emitted) per verification

    @property
    def mean_emitted(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the target's token)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0


def speculable(seq: Sequence) -> bool:
    """Sequences whose sampling does not depend on per-position history or need logprobs."""
    params = seq.params
    return params.logprobs is None and not params.needs_penalties


class Speculator:
    def __init__(self, proposer: Proposer, num_tokens: int, max_model_len: int) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    def propose(self, running: Seq[Sequence]) -> None:
        """Set draft_token_ids on every running sequence (empty where it cannot speculate)."""
        requests: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_token_ids = []
            decoding = seq.num_computed_tokens == seq.num_tokens - 1 and seq.finalizing is None
            if decoding and speculable(seq):
                remaining = seq.params.max_tokens - seq.num_output_tokens - 1
                room = self.max_model_len - seq.num_tokens - 1
                limit = min(self.num_tokens, remaining, room)
                if limit > 0:
                    requests.append((seq, limit))
        batch = getattr(self.proposer, "propose_batch", None)
        if batch is not None:
            drafts = batch(requests)
        else:
            drafts = [self.proposer.propose(seq, limit) for seq, limit in requests]
        for (seq, limit), draft in zip(requests, drafts, strict=True):
            seq.draft_token_ids = list(draft[:limit])

    def seed(self, seq: Sequence, fused: torch.Tensor, start: int) -> None:
        """Take over a prefill worker's draft window (fused features of positions start...)."""
        seed = getattr(self.proposer, "seed", None)
        if seed is not None and len(fused):
            seed(seq.seq_id, fused, start, seq.token_ids[start + 1 : start + 1 + len(fused)])

    def hand_over(self, seq_id: str) -> tuple[torch.Tensor, int] | None:
        hand_over = getattr(self.proposer, "hand_over", None)
        return hand_over(seq_id) if hand_over is not None else None

    def observe(self, chunks: Seq[ScheduledChunk], runner: ModelRunner) -> None:
        """After a step: hand the target's features of the newly committed positions to a
        proposer that reads them (EAGLE)."""
        observe = getattr(self.proposer, "observe", None)
        if observe is None or runner.features is None:
            return
        for chunk in chunks:
            seq = chunk.seq
            count = seq.num_computed_tokens - chunk.start
            if count <= 0 or seq.seq_id not in runner.rows_of:
                continue
            if seq.keep_pages:
                self.proposer.hold(seq.seq_id)  # type: ignore[attr-defined]
            begin, _ = runner.rows_of[seq.seq_id]
            next_tokens = seq.token_ids[chunk.start + 1 : chunk.start + 1 + count]
            observe(seq.seq_id, runner.features[begin : begin + count], next_tokens, chunk.start)

    def release(self, seq_ids: Iterable[str], force: bool = False) -> None:
        self.proposer.release(seq_ids, force)


def sample_step(
    result: StepResult, seqs: list[Sequence], sampler: Sampler,
    drafts: dict[str, tuple[int, ...]], stats: SpecStats | None,
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprob | None]]]:  # fmt: skip
    """Tokens (and logprobs) each sampling sequence emits this step (`seqs`: the sequences of
    `result.req_ids`)."""
    starts = [0, *itertools.accumulate(result.rows)][:-1]  # first row of each sequence
    plain = [i for i, n in enumerate(result.rows) if n == 1]
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprob | None]] = {}
    if plain:
        rows = result.logits[torch.tensor([starts[i] for i in plain])]
        plain_seqs = [seqs[i] for i in plain]
        sampled = sampler(rows, plain_seqs)
        for seq, token, logprob in zip(plain_seqs, sampled.token_ids, sampled.logprobs,
                                       strict=True):  # fmt: skip
            tokens[seq.seq_id], logprobs[seq.seq_id] = [token], [logprob]
    for i, count in enumerate(result.rows):
        if count == 1:
            continue
        seq = seqs[i]
        rows = result.logits[starts[i] : starts[i] + count]
        draft = list(drafts[seq.seq_id])
        if seq.params.greedy:
            emitted = verify_greedy(rows, draft)
        else:
            emitted = verify_sampled(
                sampler.probabilities(rows, seq), draft, sampler.generator(seq)
            )
        tokens[seq.seq_id], logprobs[seq.seq_id] = emitted, [None] * len(emitted)
        if stats is not None:
            stats.steps += 1
            stats.draft_tokens += len(draft)
            stats.accepted_tokens += len(emitted) - 1
            stats.accept_lengths[len(emitted)] += 1
            if stats.listener is not None:
                stats.listener(len(draft), len(emitted))
    return tokens, logprobs


def build_speculator(config, model_name: str, runner: ModelRunner,
                     max_model_len: int) -> Speculator | None:  # fmt: skip
    """The engine's speculator for `config.speculative` (None: no speculation)."""
    if config.speculative == "none":
        return None
    if config.speculative == "ngram":
        from kvmesh.engine.spec.ngram import NgramProposer

        proposer: Proposer = NgramProposer(config.num_speculative_tokens)
    elif config.draft_address:
        from kvmesh.mesh.draft_client import RemoteProposer

        remote = RemoteProposer(config.draft_address)
        runner.capture = remote.check_target(model_name)
        proposer = remote
    else:
        from kvmesh.engine.spec.eagle import load_head
        from kvmesh.engine.spec.eagle_proposer import EagleProposer

        head = load_head(config.draft_model, model_name)
        runner.capture = head.config.capture_layers
        proposer = EagleProposer(head, runner.model.token_embeddings)
    return Speculator(proposer, config.num_speculative_tokens, max_model_len)
