"""Turns a batch of logits into next tokens: penalties, temperature, top-k/p, min-p, seeded draws.

Order per row, as in vLLM: penalties -> (greedy: argmax) -> temperature -> top-k -> top-p -> min-p
-> random draw. Logprobs always describe the raw model distribution.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

import torch

from kvmesh.engine.core.outputs import TokenLogprob
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.platform import kernels_for

_NEG_INF = float("-inf")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the row did not ask for logprobs


class Sampler:
    """Stateless but for the per-request generators of seeded requests."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, seqs: abc.Sequence[Sequence]) -> SamplerOutput:
        """Pick one token per row of `logits` [B, V]; row i belongs to seqs[i]."""
        if all(s.params.argmax_only for s in seqs):  # hot path: one pass over the logits
            return SamplerOutput(greedy_token_ids(logits), [None] * len(seqs))
        if all(s.params.greedy and not s.params.needs_penalties for s in seqs):
            token_ids = greedy_token_ids(logits)
        else:
            token_ids = self._sample(logits.float(), seqs).tolist()
        return SamplerOutput(token_ids, compute_logprobs(logits, token_ids, seqs))

    def probabilities(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The distributions [n, V] a random draw for seq samples from (temperature, top-k,
        top-p, min-p applied; no penalties), one per row of logits [n, V]."""
        params = seq.params
        logits = logits.float() / params.temperature
        if _truncates(params):
            logits = filter_logits(logits, [params] * logits.shape[0])
        return logits.softmax(dim=-1)

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's own generator when it is seeded (None: the global one)."""
        return self._generator(seq, torch.device("cpu")) if seq.params.seed is not None else None

    def replay_draw(self, seq: Sequence, width: int) -> None:
        """Advance a seeded random request's generator past the draw that sampled its first
        token elsewhere (a prefill worker draws one uniform for it, as `_uniforms` does), so the
        tokens through the mesh are the ones a single engine samples. `width`: the vocabulary
        the draw was over (not used by this draw)."""
        if seq.params.seed is not None and not seq.params.greedy:
            torch.rand(1, generator=self._generator(seq, torch.device("cpu")))

    def release(self, seq_id: str) -> None:
        """Forget the request's generator; a later request with the same seed replays."""
        self._generators.pop(seq_id, None)

    def _sample(self, logits: torch.Tensor, seqs: abc.Sequence[Sequence]) -> torch.Tensor:
        if any(s.params.needs_penalties for s in seqs):
            logits = apply_penalties(logits, seqs)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._draw(logits[rows], [seqs[i] for i in random_rows])
        return token_ids

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        logits = logits / _column([p.temperature for p in params], logits)
        if any(_truncates(p) for p in params):
            logits = filter_logits(logits, params)
        # Inverse CDF: the first token whose cumulative probability exceeds a uniform draw of
        # the row's total (one random number per row; an exponential race drew one per token,
        # a cost that grows with the vocabulary: docs/benchmarks-history.md, "One parallel
        # region per step, weights in stream order, phases no thread holds up, and random draws
        # by inverse CDF"). A token of probability 0 is never the first to exceed it; the draw
        # stays below the total.
        cdf = logits.softmax(dim=-1).cumsum(dim=-1)
        total = cdf[:, -1:]
        below = torch.nextafter(total, torch.zeros_like(total))
        u = torch.minimum(self._uniforms(seqs, logits.device) * total, below)
        ids = torch.searchsorted(cdf, u, right=True).squeeze(1)
        broken = ~(total.squeeze(1) > 0)  # a NaN or infinite logit: no distribution to draw from
        if bool(broken.any()):
            ids[broken] = logits[broken].argmax(dim=-1)
        return ids.clamp_(max=logits.shape[-1] - 1)

    def _uniforms(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """[B, 1] uniforms in [0, 1): a seeded request's from its own generator."""
        u = torch.rand(len(seqs), 1, device=device)
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None:
                u[row] = torch.rand(1, generator=self._generator(seq, device), device=device)
        return u

    def _generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = generator
        return generator


def apply_penalties(logits: torch.Tensor, seqs: abc.Sequence[Sequence]) -> torch.Tensor:
    """Repetition (HF, prompt + output) then presence / frequency (OpenAI, output only).

    Returns a new tensor; rows whose penalties are neutral come back unchanged.
    """
    params = [s.params for s in seqs]
    vocab = logits.shape[-1]
    if any(p.repetition_penalty != 1.0 for p in params):
        ids = [s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
        seen = _token_counts(ids, vocab, logits.device) > 0
        penalty = _column([p.repetition_penalty for p in params], logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if any(_counts_output(p) for p in params):
        ids = [s.output_token_ids if _counts_output(s.params) else [] for s in seqs]
        counts = _token_counts(ids, vocab, logits.device)
        presence = _column([p.presence_penalty for p in params], logits)
        frequency = _column([p.frequency_penalty for p in params], logits)
        logits = logits - presence * (counts > 0) - frequency * counts
    return logits


def filter_logits(logits: torch.Tensor, params: abc.Sequence[SamplingParams]) -> torch.Tensor:
    """Set to -inf every token that top-k, top-p or min-p excludes (one sort for all three)."""
    vocab = logits.shape[-1]
    top_k = _column([p.top_k if p.top_k > 0 else vocab for p in params], logits, torch.int64)
    # top_p == 1 disables the cut exactly, whatever rounding the cumulative sum suffers.
    top_p = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in params], logits)
    log_min_p = _column([p.min_p for p in params], logits).log()  # log(0) = -inf: no cut
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=logits.device)
    drop = positions >= top_k
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix reaching top_p: drop a token once the mass before it is >= top_p.
    # The top token has 0 mass before it, so it is always kept.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p
    # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); ratios survive renormalisation.
    drop |= sorted_logits < sorted_logits[:, :1] + log_min_p
    kept = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, kept)


def greedy_token_ids(logits: torch.Tensor) -> list[int]:
    """`greedy_tokens` as a list, the kernel's NaN rows (-1) found in Python: two torch ops
    fewer per step (each slow after a model step has evicted the caches)."""
    tokens = _kernel_argmax(logits)
    if tokens is not None:
        ids = tokens.tolist()
        if not ids or min(ids) >= 0:
            return ids
    return logits.argmax(dim=-1).tolist()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first maximum, as torch.argmax): rows of CPU logits through
    the C++ kernel (kernels/csrc/argmax.cpp, faster than torch's: docs/benchmarks-history.md,
    "INT4 on AVX2, argmax and host work"), torch for the rest and for rows holding NaN."""
    tokens = _kernel_argmax(logits)
    if tokens is not None and not bool((tokens < 0).any()):
        return tokens
    return logits.argmax(dim=-1)


def _kernel_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """The kernel's row argmax (-1 for a row holding NaN), or None where it does not apply."""
    if logits.dim() == 2 and logits.dtype in _KERNEL_DTYPES:
        ops = kernels_for(logits)
        if ops is not None and logits.stride(-1) == 1:
            return ops.argmax_rows(logits)
    return None


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], seqs: abc.Sequence[Sequence]
) -> list[TokenLogprob | None]:
    """Logprobs of the sampled tokens under log_softmax(raw logits), for rows that ask."""
    out: list[TokenLogprob | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    chosen = torch.tensor([token_ids[i] for i in rows], device=logits.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    k = min(max(seqs[i].params.logprobs or 0 for i in rows), logits.shape[-1])
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    chosen_list, top_lp_list, top_ids_list = (
        chosen_lp.squeeze(1).tolist(),
        top_lp.tolist(),
        top_ids.tolist(),
    )
    for j, i in enumerate(rows):
        n = seqs[i].params.logprobs or 0
        top = tuple(zip(top_ids_list[j][:n], top_lp_list[j][:n], strict=True))
        out[i] = TokenLogprob(token_ids[i], chosen_list[j], ranks[j], top)
    return out


def _counts_output(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _truncates(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _column(
    values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A [B, 1] tensor on like's device, to broadcast one value per row."""
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device).unsqueeze(1)


def _token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 occurrence counts, from one padded id tensor (pad = an extra column V)."""
    width = max(map(len, ids), default=0)
    padded = torch.tensor(
        [row + [vocab] * (width - len(row)) for row in ids], dtype=torch.int64, device=device
    ).reshape(len(ids), width)
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]
