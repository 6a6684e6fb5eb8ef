"""What the speculator asks of a proposer (n-gram lookup, an EAGLE head in process, the mesh's
draft service given at construction), in full: no method is looked up at run time."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from kvmesh.engine.core.sequence import Sequence


class Proposer(Protocol):
    """Drafts tokens (n-gram lookup, an EAGLE head in process, the mesh's draft service).
    `reads_features`: it reads the target's hidden features (`observe` after each step, `seed`
    from a prefill worker's window, `hand_over` of its own window to a decode worker); one
    that does not (BlindProposer) takes them as no-ops."""

    reads_features: bool

    def propose(self, seq: Sequence, limit: int) -> list[int]: ...

    def propose_batch(self, requests: Seq[tuple[Sequence, int]]) -> list[list[int]]: ...

    def observe(
        self, seq_id: str, features: torch.Tensor, next_tokens: list[int], start: int
    ) -> None: ...

    def seed(
        self, seq_id: str, fused: torch.Tensor, start: int, next_tokens: list[int]
    ) -> None: ...

    def hand_over(self, seq_id: str) -> tuple[torch.Tensor, int] | None: ...

    def hold(self, seq_id: str) -> None: ...  # keep its state past its finish (to hand over)

    def release(self, seq_ids: Iterable[str], force: bool = False) -> None: ...


class BlindProposer:
    """What a proposer that reads no features needs beside `propose` and `release`."""

    reads_features = False

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, requests: Seq[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose(seq, limit) for seq, limit in requests]

    def observe(
        self, seq_id: str, features: torch.Tensor, next_tokens: list[int], start: int
    ) -> None:
        return None

    def seed(self, seq_id: str, fused: torch.Tensor, start: int, next_tokens: list[int]) -> None:
        return None

    def hand_over(self, seq_id: str) -> tuple[torch.Tensor, int] | None:
        return None

    def hold(self, seq_id: str) -> None:
        return None


class DraftSource(Proposer, Protocol):
    """A proposer outside the engine, given to it at construction (the mesh's draft service:
    mesh/draft_client.py): it names the target layers whose features it reads, and refuses a
    target model it does not draft for."""

    def check_target(self, model_name: str) -> tuple[int, ...]: ...
