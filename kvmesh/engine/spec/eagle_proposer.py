"""Drafting with an EAGLE head in the decode process (or the draft service): per request, the
head's own KV over the last `window` committed positions, extended as the target commits tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec.eagle import EagleHead, window_mask


@dataclass
class _State:
    keys: torch.Tensor  # [n, Hkv, D] of the last <= window committed positions
    values: torch.Tensor
    positions: torch.Tensor  # [n]
    fused: torch.Tensor  # [n, H] fused target features of those positions (for hand-over)
    last_out: torch.Tensor | None = None  # the head's output at the last committed position


class EagleProposer:
    def __init__(
        self, head: EagleHead, embed: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.head = head
        # the target's token embeddings: a [V, H] table or a lookup (INT4 tables)
        self.embed = embed.__getitem__ if isinstance(embed, torch.Tensor) else embed
        self.window = head.config.window
        self._states: dict[str, _State] = {}
        self._held: set[str] = set()  # states kept after finish (prefill hand-over)

    @torch.inference_mode()
    def observe(self, seq_id: str, features: torch.Tensor, next_tokens: list[int],
                start: int) -> None:  # fmt: skip
        """Commit target features [m, len(capture) * H] of positions start..start+m-1, whose
        following tokens are next_tokens."""
        if not next_tokens:
            return
        self.commit_fused(seq_id, self.head.fc(features.float()), next_tokens, start)

    @torch.inference_mode()
    def commit_fused(self, seq_id: str, fused: torch.Tensor, next_tokens: list[int],
                     start: int) -> None:  # fmt: skip
        head = self.head
        positions = torch.arange(start, start + len(next_tokens))
        embeds = self.embed(torch.tensor(next_tokens)).float()
        q, k, v = head.project(embeds, fused, positions)
        state = self._states.get(seq_id)
        if state is not None and int(state.positions[-1]) + 1 != start:
            state = None  # a gap (preemption, re-prefill): start over from these positions
        if state is None:
            empty = k[:0]
            state = _State(empty, empty, positions[:0], fused[:0])
        keys = torch.cat([state.keys, k])
        values = torch.cat([state.values, v])
        key_pos = torch.cat([state.positions, positions])
        attended = head.attend(q, keys, values, window_mask(positions, key_pos, self.window))
        out = head.finish(fused, attended)
        keep = slice(-self.window, None)
        self._states[seq_id] = _State(keys[keep], values[keep], key_pos[keep],
                                      torch.cat([state.fused, fused])[keep], out[-1])  # fmt: skip

    def seed(self, seq_id: str, fused: torch.Tensor, start: int, next_tokens: list[int]) -> None:
        """Start from another worker's window (see `hand_over`)."""
        self._states.pop(seq_id, None)
        self.commit_fused(seq_id, fused.float(), next_tokens, start)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.draft(seq.seq_id, limit)

    @torch.inference_mode()
    def draft(self, seq_id: str, limit: int) -> list[int]:
        """Up to `limit` greedy draft tokens after the request's last committed position."""
        state = self._states.get(seq_id)
        if state is None or state.last_out is None or limit <= 0:
            return []
        head = self.head
        keys, values, key_pos = state.keys, state.values, state.positions
        out, position = state.last_out, int(state.positions[-1])
        drafts = [int(head.d2t[head.logits(out).argmax()])]
        while len(drafts) < limit:
            position += 1
            pos = torch.tensor([position])
            embed = self.embed(torch.tensor([drafts[-1]])).float()
            q, k, v = head.project(embed, out.unsqueeze(0), pos)
            keys, values = torch.cat([keys, k]), torch.cat([values, v])
            key_pos = torch.cat([key_pos, pos])
            attended = head.attend(q, keys, values, window_mask(pos, key_pos, self.window))
            out = head.finish(out.unsqueeze(0), attended)[0]
            drafts.append(int(head.d2t[head.logits(out).argmax()]))
        return drafts

    def hand_over(self, seq_id: str) -> tuple[torch.Tensor, int] | None:
        """(fused features [n, H], first position) of the committed window, for another worker."""
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
