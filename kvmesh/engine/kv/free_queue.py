"""The pages of the pool and the O(1) free queue threaded through them (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Page:
    """One physical KV page; prev/next link it into the free queue while its ref_count is 0."""

    page_id: int
    ref_count: int = 0
    block_hash: int | None = None
    tag: int = 0  # 1..TAG_MAX once allocated; bumped on every new owner
    prev: Page | None = None
    next: Page | None = None


class FreePageQueue:
    """Doubly linked list threaded through the pages: O(1) pop, push at either end, remove."""

    def __init__(self, pages: Iterable[Page] = ()) -> None:
        self._head: Page | None = None
        self._tail: Page | None = None
        self._len = 0
        for page in pages:
            self.append(page)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Page]:
        page = self._head
        while page is not None:
            yield page
            page = page.next

    def popleft(self) -> Page:
        if self._head is None:
            raise IndexError("pop from an empty FreePageQueue")
        page = self._head
        self.remove(page)
        return page

    def append(self, page: Page) -> None:
        page.prev, page.next = self._tail, None
        if self._tail is None:
            self._head = page
        else:
            self._tail.next = page
        self._tail = page
        self._len += 1

    def appendleft(self, page: Page) -> None:
        page.prev, page.next = None, self._head
        if self._head is None:
            self._tail = page
        else:
            self._head.prev = page
        self._head = page
        self._len += 1

    def remove(self, page: Page) -> None:
        """Unlink `page`, which must be in this queue."""
        if page.prev is None:
            self._head = page.next
        else:
            page.prev.next = page.next
        if page.next is None:
            self._tail = page.prev
        else:
            page.next.prev = page.prev
        page.prev = page.next = None
        self._len -= 1
