"""What a request must be to enter the engine, and the sequence it becomes: prompt and token ids
checked against the vocabulary and the context, its grammar compiled, a migrated request's
resumed tokens replayed into its grammar and its seeded generator."""

from __future__ import annotations

from collections import abc
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.runner.constraints import Constraints
from kvmesh.engine.runner.sampler import Sampler
from kvmesh.errors import ContextLengthError, InvalidRequestError


@dataclass
class Admission:
    vocab_size: int
    max_model_len: int
    context_note: str  # why the context is what it is (e.g. capped by the KV pool)
    constraints: Constraints
    sampler: Sampler
    in_use: Callable[[str], bool]  # a request id running or reserved already

    def sequence(
        self,
        request_id: str,
        prompt: abc.Sequence[int],
        params: SamplingParams,
        cache_salt: str,
        resumed: abc.Sequence[int] = (),
    ) -> Sequence:
        """A new request's sequence, its grammar compiled. `resumed`: the output tokens another
        worker already sent (a migrated request): they count as output (max_tokens, penalties),
        its grammar is advanced past them and a seeded generator past their draws, so what
        follows is what the first worker would have sampled."""
        tokens = [*prompt, *resumed]
        self.validate(list(prompt), tokens)
        if self.in_use(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        if len(resumed) >= params.max_tokens:
            raise InvalidRequestError(
                f"{len(resumed)} resumed tokens leave nothing to generate (max_tokens "
                f"{params.max_tokens})"
            )
        seq = Sequence(request_id, list(prompt), params, tokens, cache_salt=cache_salt)
        self._constrain(request_id, params)
        if resumed and not self.constraints.commit(request_id, resumed):
            self.constraints.release(request_id)
            raise InvalidRequestError(
                f"request {request_id}: the resumed tokens do not follow the request's grammar"
            )
        for _ in resumed:  # one uniform per token sampled (speculation aside)
            self.sampler.replay_draw(seq, self.vocab_size)
        return seq

    def forget(self, request_id: str) -> None:
        """Drop a request's grammar matcher and generator (it ended, or never started)."""
        self.constraints.release(request_id)
        self.sampler.release(request_id)

    def validate(self, prompt: list[int], tokens: list[int] | None = None) -> None:
        """A prompt (and the tokens it goes on with: `tokens`) the engine can run."""
        tokens = prompt if tokens is None else tokens
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if len(tokens) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(tokens)} tokens; this model's context length is "
                f"{self.max_model_len} tokens{self.context_note}, leaving no room to generate"
            )
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )

    def _constrain(self, request_id: str, params: SamplingParams) -> None:
        """Compile the request's grammar (its matcher lives until the request ends)."""
        if any(not 0 <= token < self.vocab_size for token, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias has token ids outside [0, {self.vocab_size})")
        if params.grammar is not None:
            self.constraints.add(request_id, params.grammar)
