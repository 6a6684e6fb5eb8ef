"""One step's logits -> the tokens each sequence emits: the logits processors (logit bias,
grammar masks), plain rows sampled as a batch, rows verifying drafts checked against them.

A greedy row under a grammar is checked, not masked: a mask only takes candidates away, so the
row's argmax is the masked row's argmax whenever the grammar allows it (ties included: it is
the first maximum either way). The mask, costly over a large vocabulary, is computed only for a
row whose argmax the grammar rejects (measured: docs/benchmarks-history.md, "The 2P+2D mesh on 2
cores, and grammar masks only where the argmax needs one"). Rows that draw at random, apply
penalties or report logprobs are masked before the sampler reads them."""

from __future__ import annotations

import itertools

import torch

from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.runner.constraints import Constraints, apply_bias, apply_masks
from kvmesh.engine.runner.runner import StepResult
from kvmesh.engine.runner.sampler import Sampler, TokenLogprob, greedy_token_ids, greedy_tokens
from kvmesh.engine.spec.stats import SpecStats
from kvmesh.engine.spec.verify import verify_greedy, verify_sampled


def sample_step(
    result: StepResult,
    seqs: list[Sequence],
    sampler: Sampler,
    drafts: dict[str, tuple[int, ...]],
    stats: SpecStats | None,
    constraints: Constraints | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprob | None]]]:
    """Tokens (and logprobs) each sampling sequence emits this step (`seqs`: the sequences of
    `result.req_ids`), after the logits processors (grammar masks, logit bias)."""
    if result.logits.shape[0] == len(seqs) and not any(s.params.has_processors for s in seqs):
        # most steps: one row per sequence (no draft) and nothing to apply before the sampler
        sampled = sampler(result.logits, seqs)
        ids = [s.seq_id for s in seqs]
        tokens = {i: [t] for i, t in zip(ids, sampled.token_ids, strict=True)}
        return tokens, {i: [lp] for i, lp in zip(ids, sampled.logprobs, strict=True)}
    starts = [0, *itertools.accumulate(result.rows)][:-1]  # first row of each sequence
    checked = (
        process_logits(result, seqs, starts, drafts, constraints) if constraints is not None else []
    )
    plain = [i for i, n in enumerate(result.rows) if n == 1]
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprob | None]] = {}
    if plain:
        every = len(plain) == len(result.rows)  # no drafts: the rows are the logits, in order
        rows = result.logits if every else result.logits[torch.tensor([starts[i] for i in plain])]
        plain_seqs = [seqs[i] for i in plain]
        sampled = sampler(rows, plain_seqs)
        for seq, token, logprob in zip(
            plain_seqs, sampled.token_ids, sampled.logprobs, strict=True
        ):
            tokens[seq.seq_id], logprobs[seq.seq_id] = [token], [logprob]
    skip = set(checked)
    for i, count in enumerate(result.rows):
        if count == 1 or i in skip:  # checked: verified under the grammar below
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
    for i in checked:
        seq_id = seqs[i].seq_id
        rows = result.logits[starts[i] : starts[i] + result.rows[i]]
        # a plain row's argmax is the sampler's token already; a verifying chunk's, one pass
        choices = tokens[seq_id] if len(rows) == 1 else greedy_token_ids(rows)
        tokens[seq_id] = _grammar_checked(
            constraints, seq_id, rows, drafts.get(seq_id, ()), choices
        )
        logprobs[seq_id] = [None] * len(tokens[seq_id])
    if stats is not None:
        for i, count in enumerate(result.rows):
            if count > 1:
                stats.record(seqs[i].seq_id, count - 1, len(tokens[seqs[i].seq_id]))
    return tokens, logprobs


def process_logits(
    result: StepResult,
    seqs: list[Sequence],
    starts: list[int],
    drafts: dict[str, tuple[int, ...]],
    constraints: Constraints,
) -> list[int]:
    """Each constrained sequence's rows biased and, unless its greedy choice is checked after
    the draw (the indices returned), masked by its grammar (the row verifying draft i by the
    grammar's state after drafts[:i]), in place."""
    checked: list[int] = []
    for i, (seq, start, count) in enumerate(zip(seqs, starts, result.rows, strict=True)):
        if not seq.params.has_processors:
            continue
        with torch.inference_mode():  # the logits are an inference tensor
            rows = result.logits[start : start + count]
            if seq.params.logit_bias:
                apply_bias(rows, seq.params.logit_bias)
            if seq.seq_id not in constraints:
                continue
            params = seq.params
            if params.greedy and not params.needs_penalties and params.logprobs is None:
                checked.append(i)
            else:
                apply_masks(rows, constraints.masks(seq.seq_id, drafts.get(seq.seq_id, ())))
    return checked


def _grammar_checked(
    constraints: Constraints,
    seq_id: str,
    rows: torch.Tensor,
    draft: tuple[int, ...],
    choices: list[int],
) -> list[int]:
    """The greedy tokens of `rows` (one row, or one per draft prefix) under the grammar, given
    each row's argmax (`choices`): the argmax where the grammar surely allows it after the drafts
    before it, else the argmax of that row masked; verification goes on while the choice is the
    draft. (Drafts were cut where the grammar rejects them byte by byte, but a draft the mask
    leaves out, such as `{` where `{"` is forced, is still a choice to check.)"""
    out: list[int] = []
    while True:
        at, token = len(out), choices[len(out)]
        if not constraints.surely_allows(seq_id, draft[:at], token):
            with torch.inference_mode():
                row = rows[at : at + 1]
                apply_masks(row, constraints.mask_after(seq_id, draft[:at]))
                token = int(greedy_tokens(row)[0])
        out.append(token)
        if at == len(draft) or token != draft[at]:
            return out
