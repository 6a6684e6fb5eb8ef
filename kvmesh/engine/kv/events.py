"""KV cache events the block manager emits for routers (prefix-aware request placement)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class PagesStored:
    """Full pages newly registered in the prefix cache, in chain order.

    `parent_hash` is the hash of the page before `block_hashes[0]`, None when that is page 0.
    """

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    page_ids: tuple[int, ...]


@dataclass(frozen=True)
class PagesRemoved:
    """Pages whose hashes left the prefix cache (evicted for reuse)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllCleared:
    """The whole prefix cache was dropped."""


KvEvent: TypeAlias = PagesStored | PagesRemoved | AllCleared
