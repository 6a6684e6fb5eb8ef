"""KV-cache events over gRPC: workers stream them, the gateway keeps a prefix index from them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from kvmesh.engine.kv.events import AllCleared, KvEvent, PagesRemoved, PagesStored
from kvmesh.proto.v1 import decode_pb2

if TYPE_CHECKING:  # the gateway imports this module: no engine (torch) at run time
    from kvmesh.engine.serving.async_engine import AsyncEngine


def events_to_pb(events: Sequence[KvEvent]) -> list[decode_pb2.KvEvent]:
    out = []
    for event in events:
        if isinstance(event, PagesStored):
            out.append(decode_pb2.KvEvent(stored=event.block_hashes))
        elif isinstance(event, PagesRemoved):
            out.append(decode_pb2.KvEvent(removed=event.block_hashes))
        elif isinstance(event, AllCleared):
            out.append(decode_pb2.KvEvent(cleared=True))
    return out


async def stream_kv_events(
    engine: AsyncEngine, worker_id: str
) -> AsyncIterator[decode_pb2.KvEventBatch]:
    """The body of a worker's SubscribeKvEvents: a snapshot batch, then one batch per step."""
    async for snapshot, events in engine.kv_events():
        yield decode_pb2.KvEventBatch(
            worker_id=worker_id, snapshot=snapshot, events=events_to_pb(events)
        )


class PrefixIndex:
    """worker id -> the block hashes it caches, fed by KvEventBatch messages (pure Python)."""

    def __init__(self) -> None:
        self._hashes: dict[str, set[int]] = {}

    def apply(self, batch: decode_pb2.KvEventBatch) -> None:
        hashes = self._hashes.setdefault(batch.worker_id, set())
        if batch.snapshot:
            hashes.clear()
        for event in batch.events:
            if event.cleared:
                hashes.clear()
            hashes.update(event.stored)
            hashes.difference_update(event.removed)

    def add(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """Pages a worker is known to hold before its events say so (they correct it later)."""
        self._hashes.setdefault(worker_id, set()).update(block_hashes)

    def size(self, worker_id: str) -> int:
        """Pages the index knows `worker_id` holds."""
        return len(self._hashes.get(worker_id, ()))

    def drop(self, worker_id: str) -> None:
        self._hashes.pop(worker_id, None)

    def matched_pages(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """Leading pages of a prompt (given its chained block hashes) the worker holds."""
        held = self._hashes.get(worker_id)
        if not held:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count
