"""Paged KV block pool with a hash-based prefix cache (vLLM v1 style, pure Python).

Every page is in exactly one state: used (ref_count > 0), cached (ref 0, has a hash) or free
(ref 0, no hash). Ref-0 pages live in one doubly linked free queue: hash-less pages at the front
(reused first), cached pages at the back in LRU order, so a cache hit revives a page in O(1).

Integrity tags: every page carries a 32-bit tag, bumped each time the page is handed to a new
owner (not when a cached page is revived: its KV is still the same). A sequence records the tag
of each page it holds (`Sequence.page_tags`, sent to the runner with the step); the engine
mirrors each allocation into the pool's tag array (`take_stamps`) and, before every step,
compares the two: a page that was handed to someone else while still in use no longer carries
the tag its reader expects. A table changes only at its end (allocations append with a fresh
tag, trims pop; prefix hits go into an empty table), which `StepDiffer` relies on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv.events import AllCleared, KvEvent, PagesRemoved, PagesStored
from kvmesh.engine.kv.free_queue import FreePageQueue, Page
from kvmesh.engine.kv.hashing import BlockHasher


@dataclass(frozen=True)
class BlockManagerConfig:
    """Size of the KV pool and whether full pages are shared through the prefix cache."""

    num_pages: int
    page_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class PrefixMatch:
    """Cached pages covering a sequence's leading tokens (no references taken)."""

    page_ids: tuple[int, ...]
    num_tokens: int


TAG_MAX = (1 << 32) - 1


def next_tag(tag: int) -> int:
    """The tag after `tag`, cycling over 1..TAG_MAX (0 means "never written")."""
    return tag % TAG_MAX + 1


class BlockManager:
    """Hands out pages to sequences, shares full pages by hash and emits cache events."""

    def __init__(self, config: BlockManagerConfig, hasher: BlockHasher) -> None:
        if hasher.page_size != config.page_size:
            raise ValueError(
                f"hasher page_size {hasher.page_size} != pool page_size {config.page_size}"
            )
        self.config = config
        self.hasher = hasher
        self.pages = [Page(page_id) for page_id in range(config.num_pages)]
        self.free_queue = FreePageQueue(self.pages)
        self._cached: dict[int, Page] = {}  # block hash -> the one page registered for it
        self._num_registered: dict[str, int] = {}  # seq_id -> leading full pages processed
        self._events: list[KvEvent] = []
        self._stamps: list[tuple[int, int]] = []  # (page_id, tag) allocated since take_stamps

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take, evictable cached pages included."""
        return len(self.free_queue)

    @property
    def num_used_pages(self) -> int:
        return self.config.num_pages - len(self.free_queue)

    @property
    def num_cached_pages(self) -> int:
        """Pages with ref 0 that still hold a registered hash."""
        return sum(1 for page in self._cached.values() if page.ref_count == 0)

    @property
    def num_hashed_pages(self) -> int:
        """Pages holding a registered hash, in use or not: the set the KV events describe."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.config.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Longest cached run of seq's leading full pages, leaving at least one token to compute."""
        if not self.config.enable_prefix_caching:
            return PrefixMatch((), 0)
        self.hasher.for_tenant(seq.cache_salt).extend(seq.token_ids, seq.block_hashes)
        limit = (seq.num_tokens - 1) // self.config.page_size
        page_ids: list[int] = []
        for block_hash in seq.block_hashes[:limit]:
            page = self._cached.get(block_hash)
            if page is None:
                break
            page_ids.append(page.page_id)
        return PrefixMatch(tuple(page_ids), len(page_ids) * self.config.page_size)

    def allocate(
        self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> bool:
        """Grow seq's table to cover num_computed + num_new tokens; on failure change nothing."""
        if prefix is None:  # the common case (every decode step): no prefix to take
            needed = self.pages_needed(seq.num_computed_tokens + num_new_tokens)
            needed -= len(seq.block_table)
            if needed <= 0:
                return True
            if needed > len(self.free_queue):
                return False
            self._take_new(seq, needed)
            return True
        hits = self._prefix_pages(seq, prefix)
        computed = prefix.num_tokens if prefix is not None else seq.num_computed_tokens
        table_len = len(seq.block_table) + len(hits)
        needed = max(0, self.pages_needed(computed + num_new_tokens) - table_len)
        revived = sum(1 for page in hits if page.ref_count == 0)
        if needed + revived > len(self.free_queue):
            return False
        if prefix is not None:
            self._take_prefix(seq, hits, prefix.num_tokens)
        self._take_new(seq, needed)
        return True

    def _prefix_pages(self, seq: Sequence, prefix: PrefixMatch | None) -> list[Page]:
        if prefix is None:
            return []
        if seq.block_table:
            raise ValueError(f"{seq.seq_id}: a prefix can only be applied to an empty block table")
        hits = [self.pages[page_id] for page_id in prefix.page_ids]
        stale = [page.block_hash for page in hits] != seq.block_hashes[: len(hits)]
        if stale or len(hits) * self.config.page_size != prefix.num_tokens:
            raise ValueError(f"{seq.seq_id}: stale or foreign PrefixMatch")
        return hits

    def _take_prefix(self, seq: Sequence, hits: list[Page], num_tokens: int) -> None:
        for page in hits:
            if page.ref_count == 0:
                self.free_queue.remove(page)
            page.ref_count += 1
            seq.block_table.append(page.page_id)
            seq.page_tags.append(page.tag)
        seq.num_computed_tokens = num_tokens
        seq.num_cached_tokens = num_tokens
        self._num_registered[seq.seq_id] = len(hits)

    def _take_new(self, seq: Sequence, count: int) -> None:
        evicted: list[int] = []
        for _ in range(count):
            page = self.free_queue.popleft()
            if page.block_hash is not None:
                del self._cached[page.block_hash]
                evicted.append(page.block_hash)
                page.block_hash = None
            page.ref_count = 1
            page.tag = next_tag(page.tag)
            self._stamps.append((page.page_id, page.tag))
            seq.block_table.append(page.page_id)
            seq.page_tags.append(page.tag)
        if evicted:
            self._events.append(PagesRemoved(tuple(evicted)))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's trailing pages beyond the first num_tokens tokens (rejected drafts).
        Such pages hold no computed full page, so they were never registered in the cache."""
        keep = self.pages_needed(num_tokens)
        while len(seq.block_table) > keep:
            page = self.pages[seq.block_table.pop()]
            seq.page_tags.pop()
            page.ref_count -= 1
            if page.ref_count == 0:
                self.free_queue.appendleft(page)

    def cache_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full pages among seq's first num_tokens (KV computed) in the cache."""
        if not self.config.enable_prefix_caching:
            return
        start = self._num_registered.get(seq.seq_id, 0)
        end = min(num_tokens // self.config.page_size, len(seq.block_table))
        if end <= start:
            return  # no page filled since the last call (most decode steps)
        self.hasher.for_tenant(seq.cache_salt).extend(seq.token_ids, seq.block_hashes)
        run: list[int] = []  # indices of a contiguous run of newly registered pages
        for index in range(start, end):
            if self._register(seq, index):
                run.append(index)
            else:
                self._emit_stored(seq, run)
                run = []
        self._emit_stored(seq, run)
        self._num_registered[seq.seq_id] = max(start, end)

    def _register(self, seq: Sequence, index: int) -> bool:
        page = self.pages[seq.block_table[index]]
        block_hash = seq.block_hashes[index]
        if page.block_hash is not None or block_hash in self._cached:
            return False  # already registered (prefix hit) or a duplicate: keep the existing one
        page.block_hash = block_hash
        self._cached[block_hash] = page
        return True

    def _emit_stored(self, seq: Sequence, run: list[int]) -> None:
        if not run:
            return
        first = run[0]
        self._events.append(
            PagesStored(
                block_hashes=tuple(seq.block_hashes[i] for i in run),
                parent_hash=seq.block_hashes[first - 1] if first > 0 else None,
                page_ids=tuple(seq.block_table[i] for i in run),
            )
        )

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first; cached pages go to the back, others to the front."""
        for page_id in reversed(seq.block_table):
            page = self.pages[page_id]
            page.ref_count -= 1
            if page.ref_count < 0:
                raise AssertionError(f"page {page_id} freed more often than allocated")
            if page.ref_count == 0:
                if page.block_hash is None:
                    self.free_queue.appendleft(page)
                else:
                    self.free_queue.append(page)
        seq.block_table.clear()
        seq.page_tags.clear()
        self._num_registered.pop(seq.seq_id, None)

    def discard_cached(self, page_ids: Iterable[int]) -> None:
        """Drop these pages from the prefix cache (their bytes are not what the hash says)."""
        removed: list[int] = []
        for page_id in page_ids:
            page = self.pages[page_id]
            if page.block_hash is not None:
                del self._cached[page.block_hash]
                removed.append(page.block_hash)
                page.block_hash = None
        if removed:
            self._events.append(PagesRemoved(tuple(removed)))

    def cached_hashes(self) -> list[int]:
        """Every block hash currently in the prefix cache (a snapshot for a new subscriber)."""
        return list(self._cached)

    def take_stamps(self) -> list[tuple[int, int]]:
        """Return and clear the (page_id, new tag) of every allocation since the last call."""
        stamps, self._stamps = self._stamps, []
        return stamps

    def take_events(self) -> list[KvEvent]:
        """Return and clear the events emitted since the last call."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any page is in use."""
        if self.num_used_pages > 0:
            return False
        for page in self._cached.values():
            page.block_hash = None
        self._cached.clear()
        self._events.append(AllCleared())
        return True

    def check_integrity(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Assert the pool's invariants; with `seqs`, also that refs equal table occurrences."""
        queued = self._check_queue()
        used = sum(1 for page in self.pages if page.ref_count > 0)
        free = sum(1 for page in queued if page.block_hash is None)
        assert all(page.ref_count >= 0 for page in self.pages), "negative ref count"
        assert free + (len(queued) - free) + used == self.config.num_pages, "pool accounting"
        for block_hash, page in self._cached.items():
            assert page.block_hash == block_hash, f"hash map points at page {page.page_id} wrongly"
        tagged = sum(1 for page in self.pages if page.block_hash is not None)
        assert tagged == len(self._cached), "a page carries a hash the map does not know"
        if seqs is not None:
            self._check_refs(seqs)

    def _check_queue(self) -> list[Page]:
        queued: list[Page] = []
        seen: set[int] = set()
        for page in self.free_queue:
            assert page.page_id not in seen, f"page {page.page_id} queued twice"
            assert page.ref_count == 0, f"page {page.page_id} queued with ref {page.ref_count}"
            assert page.prev is (queued[-1] if queued else None), f"bad link at {page.page_id}"
            seen.add(page.page_id)
            queued.append(page)
        assert len(queued) == len(self.free_queue), "free queue length out of sync"
        return queued

    def _check_refs(self, seqs: Iterable[Sequence]) -> None:
        counts = [0] * self.config.num_pages
        for seq in seqs:
            for page_id in seq.block_table:
                counts[page_id] += 1
        for page in self.pages:
            assert counts[page.page_id] == page.ref_count, f"page {page.page_id} ref mismatch"
