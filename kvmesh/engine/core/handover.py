"""Pages a request holds outside the running batch across a hand-over between workers: its
states, and the one place they change (pure Python, no torch: the simulator runs it too).

    reserve ─> RESERVED ─commit─> running (the scheduler's)
                  ├─cancel─> freed
                  └─quarantine─> QUARANTINED ─end_quarantine─> freed
    add(keep_pages) ─> KEPT ─finish─> HELD ─release─> freed
                        └─release─> running on, freed when it finishes (an abort frees it)

RESERVED    a decode worker's pages for a prompt another worker prefills into them.
QUARANTINED a reservation whose prefill call failed on our side while the prefill worker may
            still be writing: its pages stay out of use until no late write can land. It is
            kept under a ticket, not the request id: the request may be retried meanwhile.
KEPT        a prefill worker's request running with keep_pages: its pages outlive it.
HELD        a KEPT request that finished: its pages wait for `release` (a transfer to the
            decode worker, then an offer to the KV store, read them).

A request prefilled again while its last prefill is HELD (a migration, a retry) supersedes it:
the older pages stay held and a `release` of that id frees the oldest first (the offer that
began first ends first).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque

from kvmesh.engine.core.sequence import FinishReason, Sequence
from kvmesh.engine.kv.block_manager import BlockManager


class HandOverState(enum.Enum):
    RESERVED = "reserved"
    QUARANTINED = "quarantined"
    KEPT = "kept"
    HELD = "held"


S = HandOverState
MOVES = frozenset(
    {
        (None, S.RESERVED),
        (S.RESERVED, None),
        (S.RESERVED, S.QUARANTINED),
        (S.QUARANTINED, None),
        (None, S.KEPT),
        (S.KEPT, S.HELD),
        (S.KEPT, None),
        (S.HELD, None),
    }
)
_OWNS_PAGES = (S.RESERVED, S.QUARANTINED, S.HELD)  # KEPT: the scheduler's while it runs


class HandOverError(RuntimeError):
    """A move the diagram above does not have: a bug in the caller, never a user's input."""


class HandOvers:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self._entries: dict[str, tuple[HandOverState, Sequence]] = {}
        self._superseded: dict[str, deque[Sequence]] = {}  # HELD, older than the id's entry
        self._tickets = itertools.count()

    def state(self, key: str) -> HandOverState | None:
        """A request id's state (or a quarantine ticket's); None when it holds nothing here."""
        entry = self._entries.get(key)
        return entry[0] if entry else None

    def seq(self, key: str) -> Sequence | None:
        entry = self._entries.get(key)
        return entry[1] if entry else None

    def counts(self) -> dict[HandOverState, int]:
        counts = dict.fromkeys(HandOverState, 0)
        for state, _ in self._entries.values():
            counts[state] += 1
        counts[S.HELD] += sum(map(len, self._superseded.values()))
        return counts

    def reserved(self, seq: Sequence) -> None:
        self._move(seq.seq_id, S.RESERVED, seq)

    def committed(self, request_id: str) -> Sequence:
        """RESERVED -> running: the scheduler owns its pages from here on."""
        return self._move(request_id, None)

    def cancel(self, request_id: str) -> Sequence | None:
        """Free a reservation's pages; nothing for a request that holds none (idempotent) nor
        for a quarantined one (its ticket frees it)."""
        if self.state(request_id) is not S.RESERVED:
            return None
        seq = self._move(request_id, None)
        self.block_manager.free(seq)
        return seq

    def quarantine(self, request_id: str) -> str:
        """RESERVED -> QUARANTINED under a new ticket (returned; `end_quarantine` takes it)."""
        seq = self._move(request_id, None)
        ticket = f"{request_id}#quarantine-{next(self._tickets)}"
        self._move(ticket, S.RESERVED, seq)
        self._move(ticket, S.QUARANTINED)
        return ticket

    def end_quarantine(self, ticket: str) -> None:
        self.block_manager.free(self._move(ticket, None))

    def kept(self, seq: Sequence) -> None:
        """A keep_pages request joined the batch; a HELD one of its id is superseded."""
        if self.state(seq.seq_id) is S.HELD:
            self._superseded.setdefault(seq.seq_id, deque()).append(
                self._entries.pop(seq.seq_id)[1]
            )
        self._move(seq.seq_id, S.KEPT, seq)

    def retired(self, seq: Sequence, reason: FinishReason) -> bool:
        """The scheduler's call when a sequence finishes: True when its pages stay (KEPT ->
        HELD); an aborted one's are freed by the scheduler (KEPT stays until released)."""
        if reason is FinishReason.ABORT or self.state(seq.seq_id) is not S.KEPT:
            return False
        self._move(seq.seq_id, S.HELD)
        return True

    def release(self, request_id: str) -> bool:
        """Free what a keep_pages request holds: the oldest HELD pages of that id; a KEPT one
        still running frees its pages when it finishes. False when it holds nothing."""
        older = self._superseded.get(request_id)
        if older:
            self.block_manager.free(older.popleft())
            if not older:
                del self._superseded[request_id]
            return True
        state = self.state(request_id)
        if state not in (S.KEPT, S.HELD):
            return False
        seq = self._move(request_id, None)
        if state is S.HELD:
            self.block_manager.free(seq)
        return True

    def _move(self, key: str, to: HandOverState | None, seq: Sequence | None = None) -> Sequence:
        """The only place a state changes: checked against MOVES."""
        entry = self._entries.get(key)
        now = entry[0] if entry else None
        if (now, to) not in MOVES:
            raise HandOverError(f"{key}: no hand-over move from {now} to {to}")
        seq = seq if entry is None else entry[1]
        if to is None:
            del self._entries[key]
        else:
            self._entries[key] = (to, seq)
        return seq


__all__ = ["MOVES", "HandOverError", "HandOverState", "HandOvers"]
