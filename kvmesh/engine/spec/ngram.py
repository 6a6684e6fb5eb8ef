"""Prompt-lookup drafting (no model): if the last n tokens appeared earlier in the sequence,
propose the tokens that followed them there. Pays off on repetitive agent output (tool calls
that quote the prompt, JSON keys, code edits). Pure Python, O(1) amortised per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.spec.proposer import BlindProposer


@dataclass
class _Index:
    upto: int = 0  # tokens indexed so far
    # n -> n-gram -> position just after its most recent occurrence (among indexed tokens)
    last_end: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)


class NgramProposer(BlindProposer):
    def __init__(self, num_tokens: int = 4, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n or num_tokens < 1:
            raise ValueError("need 1 <= min_n <= max_n and num_tokens >= 1")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(num_tokens, limit) tokens to follow seq.token_ids."""
        limit = min(limit, self.num_tokens)
        if limit <= 0:
            return []
        tokens = seq.token_ids
        index = self._indexes.setdefault(seq.seq_id, _Index())
        # Index every n-gram that ends before the last token, so a match is a strictly earlier
        # occurrence with at least one token after it.
        self._extend(index, tokens, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = index.last_end.get(n, {}).get(tuple(tokens[-n:]))
            if end is not None:
                return list(tokens[end : end + limit])
        return []

    def _extend(self, index: _Index, tokens: list[int], upto: int) -> None:
        for end in range(index.upto + 1, upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.last_end.setdefault(n, {})[tuple(tokens[end - n : end])] = end
        index.upto = max(index.upto, upto)

    def release(self, seq_ids: Iterable[str], force: bool = False) -> None:
        for seq_id in seq_ids:
            self._indexes.pop(seq_id, None)
