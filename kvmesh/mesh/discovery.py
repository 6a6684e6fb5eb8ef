"""Worker discovery through etcd (aetcd, asyncio).

Each worker puts `/kvmesh/<cluster>/workers/<role>/<worker_id>` -> WorkerInfo JSON on a lease that
a keep-alive task refreshes; a crashed worker's key expires with its lease. WorkerWatcher mirrors
the prefix into a dict, and resyncs from a fresh read whenever its watch stream breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator

import aetcd
import structlog
from aetcd.exceptions import UnauthenticatedError

from kvmesh.errors import DiscoveryError, EtcdAuthError, WorkerInfoError
from kvmesh.mesh import etcd_access
from kvmesh.mesh.etcd_access import EtcdAccess
from kvmesh.mesh.worker_info import WorkerInfo

log = structlog.get_logger(__name__)

_RPC_TIMEOUT_S = 3
_ETCD_ERRORS = (aetcd.ClientError, TimeoutError)
# Calls that land while the channel is still reconnecting retry on UNAVAILABLE, within the timeout.
_RETRY = {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2}
_SERVICE_CONFIG = {
    "methodConfig": [
        {"name": [{}], "retryPolicy": {**_RETRY, "retryableStatusCodes": ["UNAVAILABLE"]}}
    ]
}
# Reconnect quickly after an etcd restart instead of gRPC's default 1 s..120 s back-off.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.service_config": json.dumps(_SERVICE_CONFIG),
}


@contextlib.contextmanager
def _unavailable(what: str) -> Iterator[None]:
    try:
        yield
    except UnauthenticatedError as e:
        raise EtcdAuthError(f"etcd {what}: {e}") from e
    except aetcd.ClientError as e:
        raise DiscoveryError(f"etcd {what} failed: {e!r}") from e


class Registry:
    """An etcd connection scoped to one cluster's key space."""

    def __init__(
        self, endpoint: str, cluster: str = "default", access: EtcdAccess | None = None
    ) -> None:
        """`endpoint`: `host:port`, or `https://host:port` (TLS); `access`: how to reach it
        (default: this process's flags, etcd_access.configure)."""
        self.endpoint, self.cluster = endpoint, cluster
        self.prefix = f"/kvmesh/{cluster}/".encode()
        self.workers_prefix = self.prefix + b"workers/"
        self.client = (access or etcd_access.current()).client(
            endpoint, timeout=_RPC_TIMEOUT_S, options=_CHANNEL_OPTIONS
        )

    async def connect(self) -> None:
        with _unavailable("connect"):
            await self.client.connect()

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> Registry:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def worker_key(self, role: str, worker_id: str) -> bytes:
        return self.workers_prefix + f"{role}/{worker_id}".encode()

    async def put(self, key_suffix: str, value: bytes, lease: aetcd.Lease | None = None) -> None:
        """Put `<prefix><key_suffix>`, on `lease` if given (the key goes when it expires)."""
        with _unavailable("put"):
            await self.client.put(self.prefix + key_suffix.encode(), value, lease=lease)

    async def lease(self, ttl: int) -> aetcd.Lease:
        with _unavailable("lease"):
            return await self.client.lease(ttl)

    async def refresh(self, lease: aetcd.Lease) -> bool:
        """Renew `lease`; False when etcd no longer knows it (expired, or etcd was wiped)."""
        with _unavailable("lease refresh"):
            reply = await lease.refresh()
        return reply is not None and reply.TTL > 0

    async def get(self, key_suffix: str) -> bytes | None:
        with _unavailable("get"):
            got = await self.client.get(self.prefix + key_suffix.encode())
        return got.value if got is not None else None

    async def register(self, info: WorkerInfo, ttl: int = 5) -> Registration:
        """Publish `info` on a `ttl`-second lease kept alive until Registration.close()."""
        reg = Registration(self, info, ttl)
        with _unavailable("register"):
            await reg.put()
        reg.start()
        return reg

    async def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        prefix = self.workers_prefix + (f"{role}/".encode() if role else b"")
        with _unavailable("list_workers"):
            found = await self.client.get_prefix(prefix)
        return [info for kv in found if (info := _parse(kv.key, kv.value)) is not None]


class Registration:
    """A worker's key on a lease, refreshed every ttl/3 s; survives etcd outages and restarts."""

    def __init__(self, registry: Registry, info: WorkerInfo, ttl: int) -> None:
        if ttl < 2:
            raise DiscoveryError(f"ttl must be >= 2 s, got {ttl}")
        self.registry, self.info, self.ttl = registry, info, ttl
        self.key = registry.worker_key(info.role, info.worker_id)
        self._lease: aetcd.Lease | None = None
        self._task: asyncio.Task[None] | None = None

    async def put(self) -> None:
        """Grant a fresh lease and put the key on it."""
        client = self.registry.client
        self._lease = await client.lease(self.ttl)
        await client.put(self.key, self.info.to_json(), lease=self._lease)
        log.info("discovery.registered", worker=self.info.name, lease=self._lease.id)

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_alive(), name=f"keepalive:{self.info.name}")

    async def _keep_alive(self) -> None:
        period = self.ttl / 3
        while True:
            await asyncio.sleep(period)
            try:
                await asyncio.wait_for(self._refresh_once(), timeout=period)
            except _ETCD_ERRORS as e:
                log.warning("discovery.keepalive_failed", worker=self.info.name, error=repr(e))

    async def _refresh_once(self) -> None:
        assert self._lease is not None
        reply = await self._lease.refresh()
        if reply is None or reply.TTL <= 0:  # lease expired or unknown (etcd wiped): re-register
            log.warning("discovery.lease_lost", worker=self.info.name, lease=self._lease.id)
            await self.put()

    async def close(self) -> None:
        """Stop the keep-alive and revoke the lease, which deletes the key at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._lease is not None:
            try:
                await self._lease.revoke()
            except aetcd.ClientError as e:  # etcd down: the key expires with its TTL instead
                log.warning("discovery.revoke_failed", worker=self.info.name, error=repr(e))
            self._lease = None


def _parse(key: bytes, value: bytes) -> WorkerInfo | None:
    try:
        return WorkerInfo.from_json(value)
    except WorkerInfoError:
        log.warning("discovery.bad_record", key=key.decode(errors="replace"))
        return None


class WorkerWatcher:
    """Keeps `workers` ({"role/worker_id": WorkerInfo}) equal to what etcd holds.

    `on_change(name, info_or_None)` runs for every add/update (info) and removal (None).
    """

    def __init__(
        self,
        registry: Registry,
        on_change: Callable[[str, WorkerInfo | None], None] | None = None,
        max_backoff: float = 2.0,
    ) -> None:
        self.registry = registry
        self.workers: dict[str, WorkerInfo] = {}
        self._on_change = on_change
        self._max_backoff = max_backoff
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if role is None or w.role == role]

    async def start(self, timeout: float = 10.0) -> None:
        """Start watching; returns once the first full read is in (or raises DiscoveryError)."""
        self._synced.clear()
        self._task = asyncio.create_task(self._run(), name="worker-watcher")
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except TimeoutError as e:
            await self.stop()
            raise DiscoveryError(f"etcd at {self.registry.endpoint} unreachable") from e

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                revision = await self._resync()
                backoff = 0.1
                await self._follow(revision + 1)
                log.warning("discovery.watch_ended", retry_in=backoff)
            except _ETCD_ERRORS as e:
                log.warning("discovery.watch_broken", error=repr(e), retry_in=backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    async def _resync(self) -> int:
        """Replace the view with a fresh read; emit the differences. Returns the read's revision."""
        found = await self.registry.client.get_prefix(self.registry.workers_prefix)
        parsed = ((self._name_of(kv.key), _parse(kv.key, kv.value)) for kv in found)
        fresh = {name: info for name, info in parsed if info is not None}
        for name in self.workers.keys() - fresh.keys():
            self._apply(name, None)
        for name, info in fresh.items():
            if self.workers.get(name) != info:
                self._apply(name, info)
        self._synced.set()
        return found.header.revision

    async def _follow(self, start_revision: int) -> None:
        watch = await self.registry.client.watch_prefix(
            self.registry.workers_prefix, start_revision=start_revision
        )
        try:
            async for event in watch:
                self._on_event(event)
        finally:
            with contextlib.suppress(*_ETCD_ERRORS):
                await asyncio.wait_for(watch.cancel(), 1.0)

    def _name_of(self, key: bytes) -> str:
        return key[len(self.registry.workers_prefix) :].decode(errors="replace")

    def _on_event(self, event: aetcd.Event) -> None:
        name = self._name_of(event.kv.key)
        if event.kind == aetcd.EventKind.DELETE:
            if name in self.workers:
                self._apply(name, None)
        elif (info := _parse(event.kv.key, event.kv.value)) is not None:
            self._apply(name, info)

    def _apply(self, name: str, info: WorkerInfo | None) -> None:
        if info is None:
            self.workers.pop(name, None)
        else:
            self.workers[name] = info
        log.info("discovery.change", worker=name, present=info is not None)
        if self._on_change is not None:
            try:
                self._on_change(name, info)
            except Exception:
                log.exception("discovery.on_change_failed", worker=name)
