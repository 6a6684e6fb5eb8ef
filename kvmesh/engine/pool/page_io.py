"""Moving cached pages between a worker's pool and an external KV store (engine side).

Import (prefill): pages for a prompt's leading full pages that the local cache lacks are
allocated first, filled from the store by the caller, then registered in the prefix cache.
Export (decode): when a sequence finishes, its computed full pages are copied to a staging
buffer (on the engine thread, while the pages are still valid) and handed to a callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv import BlockManager
from kvmesh.engine.pool.kv_pages import KvPages


@dataclass(frozen=True)
class ImportPlan:
    """Pages to fill from the store, in order: the i-th page holds block_hashes[i]."""

    request_id: str
    block_hashes: list[int]
    page_ids: list[int]
    start_page: int  # index, among the prompt's pages, of the first page to fill


@dataclass(frozen=True)
class ExportedPages:
    """Copies of a finished sequence's full pages, in staging rows [0, len(block_hashes))."""

    block_hashes: list[int]
    staging: torch.Tensor  # [n, page_bytes] uint8
    cache_salt: str


class PageIO:
    def __init__(self, block_manager: BlockManager, kv_pages: KvPages) -> None:
        """`kv_pages`: the whole pool as transfers see it (every tensor-parallel rank's shard)."""
        self.block_manager, self.kv_pages = block_manager, kv_pages
        self._imports: dict[str, Sequence] = {}
        self._matched: dict[str, int] = {}
        self._export: tuple[Callable[[ExportedPages], None], int] | None = None

    # -- import (call under the engine lock) --------------------------------------------------
    def plan_import(
        self, request_id: str, prompt: list[int], cache_salt: str = ""
    ) -> ImportPlan | None:
        """None when the local cache already has every reusable page or the pool is full."""
        bm = self.block_manager
        seq = Sequence(
            f"import-{request_id}",
            list(prompt),
            SamplingParams(max_tokens=1),
            cache_salt=cache_salt,
        )
        prefix = bm.match_prefix(seq)
        wanted = (len(prompt) - 1) // bm.config.page_size
        matched = len(prefix.page_ids)
        if matched >= wanted:
            return None
        if not bm.allocate(seq, wanted * bm.config.page_size - prefix.num_tokens, prefix):
            return None
        self._imports[request_id] = seq
        self._matched[request_id] = matched
        return ImportPlan(
            request_id, seq.block_hashes[matched:wanted], seq.block_table[matched:wanted], matched
        )

    def finish_import(self, request_id: str, fetched_pages: int) -> None:
        """Register the first `fetched_pages` planned pages as cached; free the rest."""
        seq = self._imports.pop(request_id)
        matched = self._matched.pop(request_id)
        bm = self.block_manager
        seq.num_computed_tokens = (matched + fetched_pages) * bm.config.page_size
        bm.cache_full_pages(seq, seq.num_computed_tokens)
        bm.free(seq)

    # -- export ---------------------------------------------------------------------------------
    def export_on_finish(self, sink: Callable[[ExportedPages], None], min_pages: int = 1) -> None:
        """From now on, copy every finished sequence's computed full pages to `sink`."""
        self._export = (sink, min_pages)

    def retired(self, seq: Sequence) -> None:
        """The scheduler's: a finished sequence whose pages are about to be freed."""
        if self._export is None:
            return
        sink, min_pages = self._export
        count = min(
            seq.num_computed_tokens // self.block_manager.config.page_size, len(seq.block_hashes)
        )
        if count < min_pages:
            return
        staging = self.kv_pages.gather(seq.block_table[:count])  # every rank's shard
        sink(ExportedPages(list(seq.block_hashes[:count]), staging, seq.cache_salt))
