"""Drafting with an EAGLE head in the decode process (or the draft service): per request, the
head's own KV over the last `window` committed positions.

Committing is lazy: `observe` only queues the target's features (a copy of the rows), and the
head runs over them -- the last `window` positions at most, every request of the step in one
batch (eagle_batch.py) -- when drafts are asked for. A step whose policy drafts nothing costs
the head nothing, and a request can start drafting again later without a gap in its window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import torch

from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.spec import eagle_batch
from kvmesh.engine.spec.eagle import EagleHead
from kvmesh.engine.spec.eagle_batch import HeadState, Pending


class EagleProposer:
    reads_features = True

    def __init__(
        self, head: EagleHead, embed: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.head = head
        # the target's token embeddings: a [V, H] table or a lookup (INT4 tables)
        self.embed = embed.__getitem__ if isinstance(embed, torch.Tensor) else embed
        self.window = head.config.window
        self._states: dict[str, HeadState] = {}
        self._pending: dict[str, deque[Pending]] = {}  # committed, not run by the head yet
        self._held: set[str] = set()  # states kept after finish (prefill hand-over)

    def observe(
        self, seq_id: str, features: torch.Tensor, next_tokens: list[int], start: int
    ) -> None:
        """Commit target features [m, len(capture) * H] of positions start..start+m-1, whose
        following tokens are next_tokens. The rows are kept by reference until the head runs
        over them: the caller must not write into `features` afterwards."""
        cut = max(len(next_tokens) - self.window, 0)  # older positions leave the window
        if next_tokens:
            rows = features[cut : len(next_tokens)]
            self._queue(seq_id, Pending(rows, list(next_tokens[cut:]), start + cut))

    def seed(self, seq_id: str, fused: torch.Tensor, start: int, next_tokens: list[int]) -> None:
        """Start from another worker's window (fused features, see `hand_over`)."""
        self._states.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        if next_tokens:
            self._queue(seq_id, Pending(fused, list(next_tokens), start, True))

    def _queue(self, seq_id: str, item: Pending) -> None:
        queue = self._pending.setdefault(seq_id, deque())
        if item.start != self._next_position(seq_id):  # a gap (preemption, re-prefill, cut)
            self._states.pop(seq_id, None)
            queue.clear()
        queue.append(item)
        while len(queue) > 1 and item.end - queue[1].start >= self.window:
            queue.popleft()  # the items after it span the window: never needed

    def _next_position(self, seq_id: str) -> int | None:
        queue = self._pending.get(seq_id)
        if queue:
            return queue[-1].end
        state = self._states.get(seq_id)
        return int(state.positions[-1]) + 1 if state is not None else None

    def _catch_up(self, seq_ids: Seq[str]) -> None:
        """Run the head over the requests' pending positions, all requests in one batch."""
        ids = [seq_id for seq_id in seq_ids if self._pending.get(seq_id)]
        if not ids:
            return
        states = [self._states.get(seq_id) for seq_id in ids]
        pending = [list(self._pending.pop(seq_id)) for seq_id in ids]
        for seq_id, state in zip(
            ids, eagle_batch.commit(self.head, self.embed, states, pending), strict=True
        ):
            self._states[seq_id] = state

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.draft(seq.seq_id, limit)

    def draft(self, seq_id: str, limit: int) -> list[int]:
        """Up to `limit` greedy draft tokens after the request's last committed position."""
        return self.draft_batch([(seq_id, limit)])[0]

    def propose_batch(self, requests: Seq[tuple[Sequence, int]]) -> list[list[int]]:
        return self.draft_batch([(seq.seq_id, limit) for seq, limit in requests])

    def draft_batch(self, requests: Seq[tuple[str, int]]) -> list[list[int]]:
        """Drafts for several requests at once, in order (empty where it cannot draft)."""
        wanted = [(seq_id, limit) for seq_id, limit in requests if limit > 0]
        self._catch_up([seq_id for seq_id, _ in wanted])
        ready = [(seq_id, limit) for seq_id, limit in wanted if seq_id in self._states]
        drafts: dict[str, list[int]] = {}
        if ready:
            states = [self._states[seq_id] for seq_id, _ in ready]
            made = eagle_batch.draft(self.head, self.embed, states, [n for _, n in ready])
            drafts = {seq_id: d for (seq_id, _), d in zip(ready, made, strict=True)}
        return [drafts.get(seq_id, []) for seq_id, _ in requests]

    def hand_over(self, seq_id: str) -> tuple[torch.Tensor, int] | None:
        """(fused features [n, H], first position) of the committed window, for another worker."""
        self._catch_up([seq_id])
        state = self._states.get(seq_id)
        if state is None or not len(state.positions):
            return None
        return state.fused, int(state.positions[0])

    def hold(self, seq_id: str) -> None:
        """Keep seq's state past its finish until `release(..., force=True)` (prefill)."""
        self._held.add(seq_id)

    def release(self, seq_ids: Iterable[str], force: bool = False) -> None:
        for seq_id in seq_ids:
            if force:
                self._held.discard(seq_id)
            if seq_id not in self._held:
                self._states.pop(seq_id, None)
                self._pending.pop(seq_id, None)
