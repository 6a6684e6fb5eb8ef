"""Prefix-aware routing: follow every worker's KV events, and score workers by the prompt
tokens they would not have to compute (or receive) plus the tokens they already have in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from kvmesh.engine.kv import BlockHasher
from kvmesh.mesh import metrics
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.grpc_server import channel
from kvmesh.mesh.kv_events import PrefixIndex
from kvmesh.proto.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass
class PromptKey:
    """A prompt as the prefix index sees it: chained block hashes per (page size, KV dtype)."""

    model: str
    token_ids: list[int]
    cache_salt: str = ""
    _hashes: dict[tuple[int, str], list[int]] = field(default_factory=dict)

    def hashes(self, page_size: int, kv_dtype: str) -> list[int]:
        key = (page_size, kv_dtype)
        if key not in self._hashes:
            hasher = BlockHasher.salted(self.model, page_size, kv_dtype).for_tenant(self.cache_salt)
            self._hashes[key] = []
            hasher.extend(self.token_ids, self._hashes[key])
        return self._hashes[key]


class PrefixLookup:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def cached_tokens(self, worker: WorkerInfo, prompt: PromptKey) -> int:
        hashes = prompt.hashes(worker.page_size, worker.kv_dtype)
        return self.index.matched_pages(worker.worker_id, hashes) * worker.page_size

    def add(self, worker: WorkerInfo, prompt: PromptKey) -> None:
        self.index.add(worker.worker_id, prompt.hashes(worker.page_size, worker.kv_dtype))


class KvEventFollower:
    """Keeps one SubscribeKvEvents stream per live worker feeding the index."""

    def __init__(self, index: PrefixIndex, live: Callable[[str | None], list[WorkerInfo]]) -> None:
        self.index = index
        self._live = live
        self._tasks: dict[str, asyncio.Task] = {}

    async def run(self, period: float = 1.0) -> None:
        try:
            while True:
                self._reconcile()
                await asyncio.sleep(period)
        finally:
            for task in self._tasks.values():
                task.cancel()

    def _reconcile(self) -> None:
        live = {w.worker_id: w for w in self._live(None) if w.role in ("prefill", "decode")}
        for worker_id in [w for w in self._tasks if w not in live or self._tasks[w].done()]:
            self._tasks.pop(worker_id).cancel()
            self.index.drop(worker_id)
            with contextlib.suppress(KeyError):
                metrics.ROUTER_INDEX_PAGES.remove(worker_id)
        for worker_id, info in live.items():
            if worker_id not in self._tasks:
                self._tasks[worker_id] = asyncio.create_task(self._follow(info))

    async def _follow(self, worker: WorkerInfo) -> None:
        stub_cls = (
            prefill_pb2_grpc.PrefillStub if worker.role == "prefill" else decode_pb2_grpc.DecodeStub
        )
        with contextlib.suppress(grpc.aio.AioRpcError):
            async with channel(worker.grpc_address) as ch:
                async for batch in stub_cls(ch).SubscribeKvEvents(
                    decode_pb2.SubscribeKvEventsRequest()
                ):
                    self.index.apply(batch)
                    metrics.ROUTER_INDEX_PAGES.labels(worker.worker_id).set(
                        self.index.size(worker.worker_id)
                    )
        log.info("kv_events.stream_ended", worker=worker.worker_id)
