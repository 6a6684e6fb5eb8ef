"""Fault injection for tests: corrupt the KV bookkeeping on purpose and show it is caught.

Off unless the environment variable KVMESH_FAULTS names faults, as comma-separated `kind@N`
(inject at every N-th opportunity):

- `reassign@N`: every N-th step that decodes, the first decoding request's first page is handed
  to another (phantom) owner, as a block-manager bug would: its tag is bumped and the new owner
  writes over its bytes.
- `overwrite@N`: the same page's bytes are overwritten by a stale writer (a late transfer from
  the page's previous owner), which puts its own, old tag beside them.
- `drop_transfer@N`: every N-th prefill write to a decode worker loses its last page (bytes and
  tag), as if part of the transfer never landed.

Each injection is counted (`injected`, by kind) so tests can compare with detections.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvmesh.engine.core.scheduler import SchedulerOutput
from kvmesh.engine.kv.block_manager import next_tag
from kvmesh.engine.pool.integrity import as_int32
from kvmesh.engine.pool.kv_cache import PagedKVCache

ENV = "KVMESH_FAULTS"
KINDS = ("reassign", "overwrite", "drop_transfer")


@dataclass(frozen=True)
class FaultPlan:
    every: dict[str, int]

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        every: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            kind, _, count = item.partition("@")
            if kind not in KINDS or not count.isdigit() or int(count) < 1:
                raise ValueError(f"{ENV}: bad entry {item!r}; use kind@N with kind in {KINDS}")
            every[kind] = int(count)
        return cls(every)


class FaultInjector:
    def __init__(self, plan: FaultPlan, on_inject: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        self.injected: Counter[str] = Counter()
        self._chances: Counter[str] = Counter()
        self._noise = torch.Generator().manual_seed(1234)
        self._on_inject = on_inject  # each fault injected: its kind (metrics)

    @classmethod
    def from_env(cls, on_inject: Callable[[str], None] | None = None) -> FaultInjector | None:
        text = os.environ.get(ENV, "")
        return cls(FaultPlan.parse(text), on_inject) if text.strip() else None

    def _due(self, kind: str) -> bool:
        every = self.plan.every.get(kind)
        if every is None:
            return False
        self._chances[kind] += 1
        if self._chances[kind] % every:
            return False
        self.injected[kind] += 1
        if self._on_inject is not None:
            self._on_inject(kind)
        return True

    def before_check(self, block_manager, cache: PagedKVCache, output: SchedulerOutput) -> None:
        """Engine step, after allocations were stamped and before the integrity check."""
        decoding = [c.seq for c in output.chunks if c.num_tokens == 1 and c.seq.block_table]
        if not decoding:
            return
        page_id = decoding[0].block_table[0]
        if self._due("reassign"):
            page = block_manager.pages[page_id]
            page.tag = next_tag(page.tag)
            cache.tags[page_id] = as_int32([page.tag])[0]
            self._scribble(cache, page_id)
        elif self._due("overwrite"):
            stale = next_tag(int(cache.tags[page_id]) % (1 << 32) + 11)
            cache.tags[page_id] = as_int32([stale])[0]
            self._scribble(cache, page_id)

    def _scribble(self, cache: PagedKVCache, page_id: int) -> None:
        noise = torch.randint(0, 256, (cache.spec.page_bytes,), generator=self._noise)
        cache.pool[page_id] = noise.to(torch.uint8)

    def drop_transfer_pages(
        self, src: Seq[int], dst: Seq[int], tags: Seq[int]
    ) -> tuple[list[int], list[int], list[int]]:
        """Prefill write: on a due chance, the last page (and its tag) is not sent."""
        if src and self._due("drop_transfer"):
            return list(src[:-1]), list(dst[:-1]), list(tags[:-1])
        return list(src), list(dst), list(tags)
