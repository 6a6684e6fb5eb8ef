"""Per-page integrity tags on the pool side: stamping allocations and the per-step check.

The block manager decides tags (pure Python); this module mirrors them into the pool's int32
tag array (`PagedKVCache.tags`) and compares, in one batched gather-and-compare before each
forward pass, the tag every scheduled request expects of each page in its block table (the
runner's copy, `BlockTables`, which the step's plain data keeps up to date) with the tag the
page carries. Pages filled by another worker are stamped PENDING when reserved: only the
writer's transfer of the tags (after the page bytes) makes them readable, so a dropped or
partial transfer is caught too.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np
import torch

from kvmesh.engine.pool.block_tables import BlockTables
from kvmesh.engine.runner.host_tensors import uint32_bits

PENDING = 0  # never a valid tag (tags cycle over 1..2**32 - 1)


def as_int32(tags: Iterable[int]) -> torch.Tensor:
    """uint32 tag values as the int32 bit patterns the pool's tag array holds."""
    return uint32_bits(tags)


class PageTags:
    """The pool's tag array, in host memory on every platform (a GPU pool's tags too: the
    check then never waits for the device), read and written through a numpy view: a gather +
    compare of a full batch's pages, every step, costs less that way than in torch ops
    (docs/benchmarks-history.md, "INT4 on AVX2, argmax and host work")."""

    def __init__(self, tags: torch.Tensor) -> None:
        self.tags = tags  # [num_pages] int32, the pool's side array
        self._host = tags.numpy().view(np.uint32)
        self.failures = 0

    def stamp(self, stamps: Seq[tuple[int, int]], pending: bool = False) -> None:
        """Record allocations (page_id, tag); pending: the page waits for a remote writer."""
        if not stamps:
            return
        pages, tags = zip(*stamps, strict=True)
        self._host[list(pages)] = PENDING if pending else tags

    def mismatched(self, tables: BlockTables, req_ids: Seq[str]) -> list[tuple[int, list[int]]]:
        """The requests (index into req_ids) holding a page whose tag differs from the one
        they expect, with the offending page ids: one gather + compare over the requests' rows
        of the runner's tables for the whole batch; Python only on failure."""
        rows = tables.rows(req_ids)
        width = tables.width(rows)
        if not width:
            return []
        pages = tables.gather(rows, width)
        expected = tables.expected_tags(rows, width)
        bad = self._host[pages] != expected
        bad &= pages != tables.null_page  # padding, not a page of the request
        if not bad.any():
            return []
        failed = [(int(i), pages[i][bad[i]].tolist()) for i in np.flatnonzero(bad.any(axis=1))]
        self.failures += len(failed)
        return failed
