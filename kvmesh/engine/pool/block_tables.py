"""The runner's block tables kept across steps in numpy arrays (a persistent decode batch).

A row per request the runner knows: its page ids and the integrity tag it expects of each, null-
padded, updated from each step's new requests and diffs -- O(pages added), not O(context). A
decode step's tables are then one gather of rows (`gather`), and so is the integrity check's
expected tags; no per-step rebuild from Python lists (docs/benchmarks-history.md, "Host work
from persistent block tables, and FP8 KV where the budget bounds the batch").

Invariant: past a row's `counts[row]` pages every entry holds the null page (so a gathered
table is null-padded, as the kernels and the compiled step's fixed widths need).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTables:
    """Rows of page ids (`pages`) and expected tags (`tags`), one per request; the arrays are
    replaced when they grow, so read them through the methods, not kept references."""

    def __init__(self, null_page: int, rows: int = 64, width: int = 32) -> None:
        self.null_page = null_page
        self.pages = np.full((rows, width), null_page, dtype=np.int32)
        self.tags = np.zeros((rows, width), dtype=np.uint32)
        self.counts = [0] * rows  # pages of each row (a list: read per request per step)
        self._row: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def add(self, req_id: str, pages: Sequence[int], tags: Sequence[int]) -> None:
        """A new request (an id already known is replaced)."""
        self.remove(req_id)
        if not self._free:
            self._grow_rows()
        self._row[req_id] = self._free.pop()
        self.update(req_id, 0, pages, tags)

    def update(self, req_id: str, kept: int, pages: Sequence[int], tags: Sequence[int]) -> None:
        """The request's table keeps its first `kept` pages, then `pages` follow."""
        row = self._row[req_id]
        count, end = self.counts[row], kept + len(pages)
        if kept > count:
            raise ValueError(f"{req_id}: keeps {kept} of its {count} pages")
        if end == count == kept:  # most decode steps: nothing changed
            return
        if end > self.pages.shape[1]:
            self._grow_columns(end)
        if end < count:
            self.pages[row, end:count] = self.null_page
        if pages:
            self.pages[row, kept:end] = pages
            self.tags[row, kept:end] = tags
        self.counts[row] = end

    def remove(self, req_id: str) -> None:
        row = self._row.pop(req_id, None)
        if row is None:
            return
        self.pages[row, : self.counts[row]] = self.null_page
        self.counts[row] = 0
        self._free.append(row)

    def table(self, req_id: str) -> tuple[int, ...]:
        """One request's page ids (for paths that take tuples)."""
        row = self._row[req_id]
        return tuple(self.pages[row, : self.counts[row]].tolist())

    def rows(self, req_ids: Sequence[str]) -> list[int]:
        return [self._row[r] for r in req_ids]

    def width(self, rows: Sequence[int]) -> int:
        """The most pages any of these rows holds."""
        counts = self.counts
        return max((counts[r] for r in rows), default=0)

    def gather(self, rows: Sequence[int], width: int) -> np.ndarray:
        """[len(rows), width] int32 page ids of these rows, null-padded (a fresh array)."""
        if width > self.pages.shape[1]:
            self._grow_columns(width)
        return self.pages[rows, :width]

    def expected_tags(self, rows: Sequence[int], width: int) -> np.ndarray:
        """[len(rows), width] uint32: the tag each row expects of each page (any value past a
        row's pages: mask them by the gathered pages being the null page)."""
        return self.tags[rows, :width]

    def _grow_rows(self) -> None:
        old = self.pages.shape[0]
        self.pages = np.concatenate([self.pages, np.full_like(self.pages, self.null_page)])
        self.tags = np.concatenate([self.tags, np.zeros_like(self.tags)])
        self.counts.extend([0] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_columns(self, width: int) -> None:
        rows, old = self.pages.shape
        new = max(width, 2 * old)
        pad = ((0, 0), (0, new - old))
        self.pages = np.pad(self.pages, pad, constant_values=self.null_page)
        self.tags = np.pad(self.tags, pad)
