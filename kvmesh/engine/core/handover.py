"""The engine's side of hand-overs, as a part of `Engine` (engine.py): a decode worker reserves
pages for a prompt another worker prefills, then commits the first token (replayed into the
request's grammar); a prefill worker keeps a request's pages until `release`; a migrated request
starts where another worker left it (`resumed` tokens)."""

from __future__ import annotations

from collections import abc
from typing import TYPE_CHECKING

import torch

from kvmesh.engine.core.outputs import Reservation, TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.runner.sampler import TokenLogprob
from kvmesh.errors import ContextLengthError, InvalidRequestError

if TYPE_CHECKING:
    from kvmesh.engine.core.engine import Engine


class HandOver:
    def _new_sequence(
        self: Engine,
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
        self._validate(list(prompt), tokens)
        if self.scheduler.get(request_id) is not None or request_id in self._reserved:
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
            self.sampler.replay_draw(seq, self.model_config.vocab_size)
        return seq

    def _constrain(self: Engine, request_id: str, params: SamplingParams) -> None:
        """Compile the request's grammar (its matcher lives until the request ends)."""
        vocab = self.model_config.vocab_size
        if any(not 0 <= token < vocab for token, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias has token ids outside [0, {vocab})")
        if params.grammar is not None:
            self.constraints.add(request_id, params.grammar)

    def _validate(self: Engine, prompt: list[int], tokens: list[int] | None = None) -> None:
        """A prompt (and the tokens it goes on with: `tokens`) the engine can run."""
        tokens = prompt if tokens is None else tokens
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if len(tokens) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(tokens)} tokens; this model's context length is "
                f"{self.max_model_len} tokens{self._context_note}, leaving no room to generate"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")

    def pages_of(self: Engine, request_id: str) -> list[int]:
        """Block table of a running, reserved or kept request."""
        seq = self._reserved.get(request_id) or self._kept.get(request_id)
        seq = seq or self.scheduler.get(request_id)
        return list(seq.block_table) if seq else []

    def computed_pages_of(self: Engine, request_id: str) -> tuple[list[int], list[int]]:
        """(block hashes, page ids) of a kept request's full pages whose KV is computed."""
        seq = self._kept.get(request_id)
        if seq is None:
            return [], []
        count = min(seq.num_computed_tokens // self.config.cache.page_size, len(seq.block_hashes))
        return list(seq.block_hashes[:count]), list(seq.block_table[:count])

    def release(self: Engine, request_id: str) -> None:
        """Free the pages a finished keep_pages request still holds."""
        self._kept.pop(request_id, None)
        self.scheduler.release(request_id)
        if self.speculator is not None:
            self.speculator.release([request_id], force=True)

    def drop(self: Engine, request_id: str) -> bool:
        """Abort, and free the pages it keeps after finishing: for a consumer that went away
        before it read them (nobody else holds a keep_pages request's pages)."""
        aborted = self.abort(request_id)
        kept = request_id in self._kept or self.scheduler.holds(request_id)
        if kept:
            self.release(request_id)
        return aborted or kept

    def reserve(
        self: Engine,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        resumed: abc.Sequence[int] = (),
    ) -> Reservation | None:
        """Allocate pages for a prompt (and `resumed` tokens: see `add_request`) another worker
        will fill; None when the pool is full now."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt, resumed)
        prefix = self.block_manager.match_prefix(seq)
        self.page_tags.stamp(self.block_manager.take_stamps())
        if not self.block_manager.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix):
            self.constraints.release(request_id)
            self.sampler.release(request_id)
            return None
        # The new pages are readable only once the prefill worker has written their tags.
        self.page_tags.stamp(self.block_manager.take_stamps(), pending=True)
        self._reserved[request_id] = seq
        return Reservation(
            list(seq.block_table), len(prefix.page_ids), prefix.num_tokens, list(seq.page_tags)
        )

    def commit_prefilled(
        self: Engine,
        request_id: str,
        first_token: int,
        logprob: TokenLogprob | None,
        cached_tokens: int,
        draft_window: tuple[torch.Tensor, int] | None = None,
    ) -> TokenOutput:
        """The reserved pages now hold the prompt's KV: join the batch with the first token
        (and, with EAGLE, the draft head's window of fused features from the prefill worker)."""
        seq = self._reserved.pop(request_id)
        seq.num_cached_tokens = max(seq.num_cached_tokens, cached_tokens)
        if not self.constraints.commit(request_id, [first_token]):  # replayed: one grammar state
            self.block_manager.free(seq)
            self.constraints.release(request_id)
            self.sampler.release(request_id)
            raise InvalidRequestError(
                f"request {request_id}: the prefilled first token {first_token} does not follow "
                "the request's grammar (prefill and decode disagree on it)"
            )
        # a seeded draw: this request's generator continues where the prefill worker's stopped
        self.sampler.replay_draw(seq, self.model_config.vocab_size)
        reason = self.scheduler.add_prefilled(seq, first_token)
        if reason is None and draft_window is not None and self.speculator is not None:
            self.speculator.seed(seq, *draft_window)
        return TokenOutput(
            request_id,
            [first_token],
            [logprob],
            reason is not None,
            reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
        )

    def cancel_reservation(self: Engine, request_id: str) -> None:
        """Free reserved pages; only once no transfer into them can still land."""
        seq = self._reserved.pop(request_id, None)
        self.constraints.release(request_id)
        self.sampler.release(request_id)
        if seq is not None:
            self.block_manager.free(seq)
