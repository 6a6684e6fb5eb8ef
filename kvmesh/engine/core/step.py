"""The step boundary as plain data (pure Python): what the scheduler tells the model runner.

A request is sent once (`NewRequest`: its tokens and pages so far, with the integrity tag it
expects of each page), then each step only what changed (`RequestDiff`: tokens appended since,
pages kept and added, with their tags); `finished` names requests whose state the runner drops
(finished, aborted or preempted: a preempted request comes back as new). `chunks` say which
tokens of which requests run this step. The runner keeps its own per-request copy of tokens,
pages and tags, so this is everything a runner -- or a tensor-parallel rank that receives it by
broadcast -- needs; no live `Sequence` crosses the boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)  # built per sequence per step: not frozen (slower to build); never mutated
class NewRequest:
    req_id: str
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    page_tags: tuple[int, ...]  # the integrity tag expected of each page (integrity.py)


@dataclass(slots=True)  # built per sequence per step: not frozen (slower to build); never mutated
class RequestDiff:
    req_id: str
    new_token_ids: tuple[int, ...]  # appended since the last step that sent this request
    num_blocks_kept: int  # the table keeps this many pages (a trim, or a page re-allocated)...
    new_block_ids: tuple[int, ...]  # ...then these follow
    new_page_tags: tuple[int, ...]  # with the tags expected of them


@dataclass(slots=True)  # built per sequence per step: not frozen (slower to build); never mutated
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
    def one_shot(
        cls,
        req_id: str,
        token_ids: Iterable[int],
        block_table: Iterable[int],
        page_tags: Iterable[int],
        chunk: ChunkPlan,
    ) -> StepPlan:
        """A request sent and run once (the runner's `score` forgets it afterwards)."""
        new = NewRequest(req_id, tuple(token_ids), tuple(block_table), tuple(page_tags))
        return cls((new,), (), (chunk,), ())


class StepDiffer:
    """Remembers what the runner was told about each request and turns the current state of
    the scheduled requests into a `StepPlan` of diffs.

    A request's pages change only at the end of its table (allocations append, trims cut the
    end; a preempted request comes back new) and a page allocated again gets a new tag, so a
    table whose length and last (page, tag) are those sent is the table sent: most decode
    steps, checked without touching the rest of the table."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}  # req_id -> tokens sent
        self._pages: dict[str, tuple[list[int], list[int]]] = {}  # req_id -> (pages, tags) sent
        self._finished: list[str] = []

    def forget(self, req_id: str) -> None:
        """The request leaves the runner (finished, aborted or preempted)."""
        if self._tokens.pop(req_id, None) is not None:
            del self._pages[req_id]
            self._finished.append(req_id)

    def plan(
        self,
        requests: Iterable[tuple[str, list[int], list[int], list[int]]],
        chunks: tuple[ChunkPlan, ...],
    ) -> StepPlan:
        """requests: (req_id, token ids, block table, page tags) of every request a chunk
        names."""
        new, diffs = [], []
        sent_tokens, sent_pages = self._tokens, self._pages
        for req_id, tokens, table, tags in requests:
            sent = sent_pages.get(req_id)
            if sent is None:
                new.append(NewRequest(req_id, tuple(tokens), tuple(table), tuple(tags)))
                sent_pages[req_id] = (table[:], tags[:])
            else:
                fresh = tuple(tokens[sent_tokens[req_id] :])
                pages, page_tags = sent
                count = len(table)
                # the table sent, judged by its length and last (page, tag): see the class
                if count == len(pages) and (
                    not count or (table[-1] == pages[-1] and tags[-1] == page_tags[-1])
                ):
                    diffs.append(RequestDiff(req_id, fresh, count, (), ()))
                else:
                    diffs.append(self._diff(req_id, fresh, table, tags, sent))
            sent_tokens[req_id] = len(tokens)
        finished, self._finished = tuple(self._finished), []
        return StepPlan(tuple(new), tuple(diffs), chunks, finished)

    def _diff(
        self,
        req_id: str,
        fresh: tuple[int, ...],
        table: list[int],
        tags: list[int],
        sent: tuple[list[int], list[int]],
    ) -> RequestDiff:
        """A page whose id stays but whose tag changed (freed by a trim, allocated again at
        the same place) counts as changed: the runner must expect its new tag."""
        was, now = zip(*sent, strict=True), zip(table, tags, strict=True)
        same = (i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b)
        kept = next(same, min(len(sent[0]), len(table)))
        self._pages[req_id] = (table[:], tags[:])
        return RequestDiff(req_id, fresh, kept, tuple(table[kept:]), tuple(tags[kept:]))
