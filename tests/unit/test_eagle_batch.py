"""The EAGLE proposer's lazy, batched commit and drafting against a one-position-at-a-time
reference on a random head: the same drafts, across gaps, long chunks and many requests."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.engine.spec.eagle import EagleConfig, EagleHead, window_mask
from kvmesh.engine.spec.eagle_proposer import EagleProposer

WINDOW = 6


@pytest.fixture(scope="module")
def head() -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig("t", 32, 4, 2, 8, 64, (0, 1, 2), 50, window=WINDOW)).eval()
    for param in head.parameters():
        param.data.normal_(0, 0.5)
    head.d2t.copy_(torch.arange(50) * 2)
    return head


class _Reference:
    """Each committed position run alone over the window before it; drafts one by one."""

    def __init__(self, head: EagleHead, embed: torch.Tensor) -> None:
        self.head, self.embed = head, embed
        self.keys: dict[str, list] = {}  # seq_id -> [(position, k, v)]
        self.out: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def observe(self, seq_id: str, features, next_tokens: list[int], start: int) -> None:
        kept = self.keys.setdefault(seq_id, [])
        if kept and kept[-1][0] + 1 != start:
            kept.clear()
        for i, token in enumerate(next_tokens):
            fused = self.head.fc(features[i : i + 1])
            self.out[seq_id] = self._step(kept, self.embed[[token]], fused, start + i)

    def _step(self, kept: list, embed, hidden, position: int) -> torch.Tensor:
        pos = torch.tensor([position])
        q, k, v = self.head.project(embed, hidden, pos)
        kept.append((position, k[0], v[0]))
        del kept[:-WINDOW]
        keys = torch.stack([k for _, k, _ in kept])
        values = torch.stack([v for _, _, v in kept])
        mask = window_mask(pos, torch.tensor([p for p, _, _ in kept]), WINDOW)
        return self.head.finish(hidden, self.head.attend(q, keys, values, mask))

    @torch.inference_mode()
    def draft(self, seq_id: str, limit: int) -> list[int]:
        kept, out = list(self.keys[seq_id]), self.out[seq_id]
        drafts = [int(self.head.d2t[self.head.logits(out).argmax()])]
        while len(drafts) < limit:
            position = kept[-1][0] + 1
            out = self._step(kept, self.embed[[drafts[-1]]], out, position)
            drafts.append(int(self.head.d2t[self.head.logits(out).argmax()]))
        return drafts


def test_batched_lazy_drafts_equal_the_reference(head):
    embed = torch.randn(100, 32)
    proposer, reference = EagleProposer(head, embed), _Reference(head, embed)
    rng = random.Random(0)
    position = dict.fromkeys("abcd", 0)
    checked = 0
    for step in range(30):
        for seq_id in "abcd":
            m = rng.choice([1, 1, 2, 3, 9]) if position[seq_id] else rng.choice([3, 12])
            features = torch.randn(m, 96)
            tokens = [rng.randrange(100) for _ in range(m)]
            for p in (proposer, reference):
                p.observe(seq_id, features, tokens, position[seq_id])
            position[seq_id] += m
        asked = [(s, rng.randint(1, 5)) for s in "abcd" if rng.random() < 0.6]
        got = proposer.draft_batch(asked)
        assert got == [reference.draft(s, n) for s, n in asked]
        checked += len(asked)
        if step == 12:
            position["b"] += 5  # a gap: the window starts over
    assert checked > 50


def test_a_window_handed_over_drafts_as_the_original(head):
    embed = torch.randn(100, 32)
    prefill, decode = EagleProposer(head, embed), EagleProposer(head, embed)
    tokens = list(range(10, 30))
    prefill.hold("r")
    prefill.observe("r", torch.randn(20, 96), tokens, 0)
    prefill.release(["r"])  # finished, but held for the hand-over
    fused, start = prefill.hand_over("r")
    assert len(fused) == WINDOW and start == 20 - WINDOW
    decode.seed("r", fused, start, tokens[start:])
    assert decode.draft("r", 4) == prefill.draft("r", 4)
    prefill.release(["r"], force=True)
    assert prefill.draft("r", 4) == []
