"""The step boundary as plain data (pure Python): what the scheduler tells the model runner.

A request is sent once (`NewRequest`: its tokens and pages so far), then each step only what
changed (`RequestDiff`: tokens appended since, pages kept and added); `finished` names requests
whose state the runner drops (finished, aborted or preempted: a preempted request comes back
as new). `chunks` say which tokens of which requests run this step. The runner keeps its own
per-request copy of tokens and pages, so this is everything a runner -- or a tensor-parallel
rank that receives it by broadcast -- needs; no live `Sequence` crosses the boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)  # built per sequence per step: not frozen (~1 us more each); never mutated
class NewRequest:
    req_id: str
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]


@dataclass(slots=True)  # built per sequence per step: not frozen (~1 us more each); never mutated
class RequestDiff:
    req_id: str
    new_token_ids: tuple[int, ...]  # appended since the last step that sent this request
    num_blocks_kept: int  # the block table keeps this many pages (speculation trims)...
    new_block_ids: tuple[int, ...]  # ...then these follow


@dataclass(slots=True)  # built per sequence per step: not frozen (~1 us more each); never mutated
class ChunkPlan:
    """Tokens [start, start + num_tokens) of a request run this step, then `draft` (tokens to
    verify); `sample` when the chunk reaches the request's last token."""

    req_id: str
    start: int
    num_tokens: int
    sample: bool
    draft: tuple[int, ...] = ()

    @property
    def width(self) -> int:
        """Rows this chunk adds to the step."""
        return self.num_tokens + len(self.draft)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and not self.draft


@dataclass(frozen=True)
class StepPlan:
    new: tuple[NewRequest, ...]
    diffs: tuple[RequestDiff, ...]
    chunks: tuple[ChunkPlan, ...]
    finished: tuple[str, ...]

    @classmethod
    def one_shot(cls, req_id: str, token_ids: Iterable[int], block_table: Iterable[int],
                 chunk: ChunkPlan) -> StepPlan:  # fmt: skip
        """A request sent and run once (the runner's `score` forgets it afterwards)."""
        new = NewRequest(req_id, tuple(token_ids), tuple(block_table))
        return cls((new,), (), (chunk,), ())


class StepDiffer:
    """Remembers what the runner was told about each request and turns the current state of
    the scheduled requests into a `StepPlan` of diffs."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}  # req_id -> tokens sent
        self._blocks: dict[str, list[int]] = {}  # req_id -> block table sent
        self._finished: list[str] = []

    def forget(self, req_id: str) -> None:
        """The request leaves the runner (finished, aborted or preempted)."""
        if self._tokens.pop(req_id, None) is not None:
            del self._blocks[req_id]
            self._finished.append(req_id)

    def plan(self, requests: Iterable[tuple[str, list[int], list[int]]],
             chunks: tuple[ChunkPlan, ...]) -> StepPlan:  # fmt: skip
        """requests: (req_id, token ids, block table) of every request a chunk names."""
        new, diffs = [], []
        for req_id, tokens, table in requests:
            if req_id not in self._tokens:
                new.append(NewRequest(req_id, tuple(tokens), tuple(table)))
            else:
                diffs.append(self._diff(req_id, tokens, table))
            self._tokens[req_id] = len(tokens)
            self._blocks[req_id] = list(table)
        finished, self._finished = tuple(self._finished), []
        return StepPlan(tuple(new), tuple(diffs), chunks, finished)

    def _diff(self, req_id: str, tokens: list[int], table: list[int]) -> RequestDiff:
        sent = self._blocks[req_id]
        kept = min(len(sent), len(table))
        if table[:kept] != sent[:kept]:
            kept = next(i for i, (a, b) in enumerate(zip(sent, table, strict=False)) if a != b)
        return RequestDiff(req_id, tuple(tokens[self._tokens[req_id] :]), kept, tuple(table[kept:]))
