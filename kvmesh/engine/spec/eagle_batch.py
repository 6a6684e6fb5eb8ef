"""The EAGLE head run for many requests at once: committing target features and drafting.

A committed position's head KV depends on that position's own inputs only (fused features and
the next token's embedding), so committing is one batched projection of every pending row; the
head's output -- the input of the first draft -- is needed at each request's last position
only: one batched attention of those rows over their windows. Drafting runs step j of every
request together; windows of different lengths are padded, and padding slots carry a position
no query can see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.spec.eagle import EagleHead, window_mask

Embed = Callable[[torch.Tensor], torch.Tensor]  # token ids -> the target's embeddings
UNSEEN = -(1 << 30)  # position of a padding slot: outside every query's window


@dataclass
class HeadState:
    """A request's head KV over its last <= window committed positions."""

    keys: torch.Tensor  # [n, Hkv, D]
    values: torch.Tensor
    positions: torch.Tensor  # [n]
    fused: torch.Tensor  # [n, H] fused target features of those positions (for hand-over)
    last_out: torch.Tensor  # [H] the head's output at the last committed position


@dataclass
class Pending:
    """Committed positions start..start+m-1 not run through the head yet."""

    rows: torch.Tensor  # [m, F] captured target features, or [m, H] already fused
    next_tokens: list[int]  # the token after each position
    start: int
    fused: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.next_tokens)


@torch.inference_mode()
def commit(
    head: EagleHead,
    embed: Embed,
    states: Sequence[HeadState | None],
    pending: Sequence[list[Pending]],
) -> list[HeadState]:
    """Each request's state after its pending positions (contiguous with the state, or the
    state is None); only the last `window` positions are run."""
    window = head.config.window
    items = [_last_rows(queue, window) for queue in pending]
    flat = [item for queue in items for item in queue]
    fused = _fuse(head, flat)
    tokens = torch.tensor([t for item in flat for t in item.next_tokens])
    positions = torch.cat([torch.arange(item.start, item.end) for item in flat])
    q, k, v = head.project(embed(tokens).float(), fused, positions)
    sizes = [sum(len(item.next_tokens) for item in queue) for queue in items]
    out: list[HeadState] = []
    for state, k_i, v_i, f_i, p_i in zip(
        states,
        k.split(sizes),
        v.split(sizes),
        fused.split(sizes),
        positions.split(sizes),
        strict=True,
    ):
        old = state if state is not None else _empty(k_i, f_i)
        keep = slice(-window, None)
        out.append(
            HeadState(
                torch.cat([old.keys, k_i])[keep],
                torch.cat([old.values, v_i])[keep],
                torch.cat([old.positions, p_i])[keep],
                torch.cat([old.fused, f_i])[keep],
                f_i[-1],
            )
        )
    lasts = torch.stack([q_i[-1] for q_i in q.split(sizes)])
    attended = _attend(head, lasts, out, torch.stack([s.positions[-1] for s in out]))
    outputs = head.finish(torch.stack([s.last_out for s in out]), attended)
    for state, row in zip(out, outputs, strict=True):
        state.last_out = row
    return out


@torch.inference_mode()
def draft(
    head: EagleHead, embed: Embed, states: Sequence[HeadState], limits: Sequence[int]
) -> list[list[int]]:
    """Greedy drafts after each request's last committed position, limits[i] for request i."""
    outs = torch.stack([s.last_out for s in states])
    tokens = head.d2t[head.logits(outs).argmax(dim=-1)]
    drafts = [[int(t)] for t in tokens]
    steps = max(limits)
    if steps > 1:
        keys, values, key_pos, lengths = _padded(states, steps - 1)
        position = torch.stack([s.positions[-1] for s in states])
        rows = torch.arange(len(states))
        for j in range(1, steps):
            q, k, v = head.project(embed(tokens).float(), outs, position + j)
            slot = lengths + j - 1
            keys[rows, slot], values[rows, slot], key_pos[rows, slot] = k, v, position + j
            mask = window_mask((position + j).unsqueeze(-1), key_pos, head.config.window)
            attended = head.attend(q.unsqueeze(1), keys, values, mask)[:, 0]
            outs = head.finish(outs, attended)
            tokens = head.d2t[head.logits(outs).argmax(dim=-1)]
            for i, token in enumerate(tokens.tolist()):
                if j < limits[i]:
                    drafts[i].append(token)
    return drafts


def _last_rows(queue: list[Pending], window: int) -> list[Pending]:
    """The queue's items cut to its last `window` positions."""
    kept: list[Pending] = []
    room = window
    for item in reversed(queue):
        if room <= 0:
            break
        take = min(room, len(item.next_tokens))
        cut = len(item.next_tokens) - take
        kept.append(Pending(item.rows[cut:], item.next_tokens[cut:], item.start + cut, item.fused))
        room -= take
    return kept[::-1]


def _fuse(head: EagleHead, items: Sequence[Pending]) -> torch.Tensor:
    """[sum m, H] fused features of the items' rows (one fc for all raw rows)."""
    raw = [item.rows for item in items if not item.fused]
    fused_raw = list(head.fc(torch.cat(raw).float()).split([len(r) for r in raw])) if raw else []
    parts, taken = [], 0
    for item in items:
        if item.fused:
            parts.append(item.rows.float())
        else:
            parts.append(fused_raw[taken])
            taken += 1
    return torch.cat(parts)


def _empty(k: torch.Tensor, fused: torch.Tensor) -> HeadState:
    return HeadState(k[:0], k[:0], torch.zeros(0, dtype=torch.long), fused[:0], fused[-1])


def _attend(
    head: EagleHead, q: torch.Tensor, states: Sequence[HeadState], position: torch.Tensor
) -> torch.Tensor:
    """q [N, Hq, D] at `position` [N] over each state's window -> [N, Hq, D]."""
    keys, values, key_pos, _ = _padded(states, 0)
    mask = window_mask(position.unsqueeze(-1), key_pos, head.config.window)
    return head.attend(q.unsqueeze(1), keys, values, mask)[:, 0]


def _padded(states: Sequence[HeadState], extra: int):
    """Keys and values [N, L, Hkv, D], key positions [N, L] (UNSEEN where padded) and lengths
    [N] of the states' windows, with `extra` free slots after the longest."""
    lengths = torch.tensor([len(s.positions) for s in states])
    width = int(lengths.max()) + extra
    first = states[0].keys
    keys = first.new_zeros(len(states), width, *first.shape[1:])
    values = torch.zeros_like(keys)
    key_pos = torch.full((len(states), width), UNSEEN, dtype=torch.long)
    for i, s in enumerate(states):
        n = len(s.positions)
        keys[i, :n], values[i, :n], key_pos[i, :n] = s.keys, s.values, s.positions
    return keys, values, key_pos, lengths
