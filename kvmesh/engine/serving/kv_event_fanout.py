"""A step's KV events (pages stored in / removed from the prefix cache) to every subscriber:
the engine thread publishes them; each subscriber reads them on its own event loop, after a
snapshot of the whole prefix cache taken at the moment it subscribed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvmesh.engine.kv.events import KvEvent, PagesStored


class KvEventFanOut:
    def __init__(self) -> None:
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []

    def publish(self, events: list[KvEvent]) -> None:
        """Engine thread, under the engine's lock: hand a step's events to every subscriber."""
        for loop, queue in list(self._subscribers):
            loop.call_soon_threadsafe(queue.put_nowait, events)

    async def follow(
        self, call: Callable[..., Awaitable[Any]], cached_hashes: Callable[[], list[int]]
    ) -> AsyncIterator[tuple[bool, list[KvEvent]]]:
        """(is_snapshot, events): first the whole prefix cache as one PagesStored, then the
        changes. `call` runs the subscription between steps, so none is missed or doubled."""
        entry = (asyncio.get_running_loop(), asyncio.Queue())

        def subscribe() -> list[int]:
            self._subscribers.append(entry)
            return cached_hashes()

        snapshot = await call(subscribe)
        try:
            yield True, [PagesStored(tuple(snapshot), None, ())]
            while True:
                yield False, await entry[1].get()
        finally:
            self._subscribers.remove(entry)
