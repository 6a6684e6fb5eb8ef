"""A discrete-event clock: callbacks run in time order (ties in the order they were set)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        heapq.heappush(self._queue, (when, next(self._order), fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, until: float | None = None) -> None:
        """Run events in order; with `until`, stop before the first one after it."""
        while self._queue:
            when, _, fn, args = self._queue[0]
            if until is not None and when > until:
                self.now = until
                return
            heapq.heappop(self._queue)
            self.now = when
            fn(*args)

    @property
    def pending(self) -> int:
        return len(self._queue)
