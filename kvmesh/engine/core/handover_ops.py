"""The engine's side of hand-overs (`engine.handover`): a decode worker reserves pages for a
prompt another worker prefills, then commits the first token (replayed into the request's
grammar); a prefill worker keeps a request's pages until `release`. The states and their moves
are handover.py's."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

import torch

from kvmesh.engine.core.admission import Admission
from kvmesh.engine.core.handover import HandOvers, HandOverState
from kvmesh.engine.core.outputs import Reservation, TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.scheduler import Scheduler
from kvmesh.engine.kv import BlockManager
from kvmesh.engine.pool.integrity import PageTags
from kvmesh.engine.runner.sampler import TokenLogprob
from kvmesh.engine.spec.speculator import Speculator
from kvmesh.errors import InvalidRequestError


@dataclass
class EngineHandOver:
    states: HandOvers
    admission: Admission
    block_manager: BlockManager
    scheduler: Scheduler
    page_tags: PageTags
    speculator: Speculator | None

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        resumed: abc.Sequence[int] = (),
    ) -> Reservation | None:
        """Allocate pages for a prompt (and `resumed` tokens: see `Engine.add_request`) another
        worker will fill; None when the pool is full now."""
        seq = self.admission.sequence(request_id, prompt_token_ids, params, cache_salt, resumed)
        prefix = self.block_manager.match_prefix(seq)
        self.page_tags.stamp(self.block_manager.take_stamps())
        if not self.block_manager.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix):
            self.admission.forget(request_id)
            return None
        # The new pages are readable only once the prefill worker has written their tags.
        self.page_tags.stamp(self.block_manager.take_stamps(), pending=True)
        self.states.reserved(seq)
        return Reservation(
            list(seq.block_table), len(prefix.page_ids), prefix.num_tokens, list(seq.page_tags)
        )

    def commit_prefilled(
        self,
        request_id: str,
        first_token: int,
        logprob: TokenLogprob | None,
        cached_tokens: int,
        draft_window: tuple[torch.Tensor, int] | None = None,
    ) -> TokenOutput:
        """The reserved pages now hold the prompt's KV: join the batch with the first token
        (and, with EAGLE, the draft head's window of fused features from the prefill worker)."""
        seq = self.states.committed(request_id)
        seq.num_cached_tokens = max(seq.num_cached_tokens, cached_tokens)
        if not self.admission.constraints.commit(request_id, [first_token]):  # one state: replayed
            self.block_manager.free(seq)
            self.admission.forget(request_id)
            raise InvalidRequestError(
                f"request {request_id}: the prefilled first token {first_token} does not follow "
                "the request's grammar (prefill and decode disagree on it)"
            )
        # a seeded draw: this request's generator continues where the prefill worker's stopped
        self.admission.sampler.replay_draw(seq, self.admission.vocab_size)
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

    def cancel_reservation(self, request_id: str) -> None:
        """Free reserved pages; only once no transfer into them can still land. Idempotent;
        a quarantined reservation's pages wait for `end_quarantine`."""
        self.admission.forget(request_id)
        self.states.cancel(request_id)

    def quarantine(self, request_id: str) -> str:
        """Hold a reservation's pages while a failed prefill call may still write into them;
        the request id is free again. Returns the ticket `end_quarantine` takes."""
        self.admission.forget(request_id)
        return self.states.quarantine(request_id)

    def end_quarantine(self, ticket: str) -> None:
        self.states.end_quarantine(ticket)

    def pages_of(self, request_id: str) -> list[int]:
        """Block table of a running, reserved or kept request."""
        seq = self.states.seq(request_id) or self.scheduler.get(request_id)
        return list(seq.block_table) if seq else []

    def computed_pages_of(self, request_id: str) -> tuple[list[int], list[int]]:
        """(block hashes, page ids) of a kept request's full pages whose KV is computed."""
        if self.states.state(request_id) not in (HandOverState.KEPT, HandOverState.HELD):
            return [], []
        seq = self.states.seq(request_id)
        page_size = self.block_manager.config.page_size
        count = min(seq.num_computed_tokens // page_size, len(seq.block_hashes))
        return list(seq.block_hashes[:count]), list(seq.block_table[:count])

    def release(self, request_id: str) -> bool:
        """Free the pages a finished keep_pages request still holds."""
        released = self.states.release(request_id)
        if self.speculator is not None:
            self.speculator.release([request_id], force=True)
        return released
