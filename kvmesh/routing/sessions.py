"""Session affinity state in etcd: /kvmesh/<cluster>/sessions/<id> -> the (prefill, decode) pair,
on one lease per session that every use renews (a new lease only when the old one expired)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import structlog

from kvmesh.errors import KvmeshError
from kvmesh.mesh.discovery import Registry

log = structlog.get_logger(__name__)
MAX_TRACKED_SESSIONS = 100_000  # leases remembered here; a forgotten one just expires in etcd


@dataclass(frozen=True)
class Pin:
    """The workers a session is pinned to; prefill may be empty (decode prefills itself)."""

    prefill: str
    decode: str


@dataclass
class _Held:
    lease: Any  # aetcd.Lease
    value: bytes


class SessionStore:
    def __init__(self, registry: Registry, ttl: int = 600) -> None:
        self.registry = registry
        self.ttl = ttl
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently pinned first

    async def lookup(self, session_id: str) -> Pin | None:
        try:
            raw = await self.registry.get(_key(session_id))
        except KvmeshError as exc:  # etcd down: route without affinity rather than fail
            log.warning("sessions.lookup_failed", error=str(exc))
            return None
        if raw is None:
            return None
        data = json.loads(raw)
        return Pin(data.get("prefill", ""), data.get("decode", ""))

    async def pin(self, session_id: str, pin: Pin) -> None:
        """Store the pin, or renew it: the session's lease is refreshed, the key rewritten only
        when the pair changed; a new lease only for a new session or an expired lease."""
        value = json.dumps({"prefill": pin.prefill, "decode": pin.decode}).encode()
        try:
            await self._pin(session_id, value)
        except KvmeshError as exc:
            log.warning("sessions.pin_failed", error=str(exc))
            self._held.pop(session_id, None)

    async def _pin(self, session_id: str, value: bytes) -> None:
        held = self._held.get(session_id)
        if held is not None and await self.registry.refresh(held.lease):
            self._held.move_to_end(session_id)
            if held.value != value:
                await self.registry.put(_key(session_id), value, lease=held.lease)
                held.value = value
            return
        lease = await self.registry.lease(self.ttl)
        await self.registry.put(_key(session_id), value, lease=lease)
        self._held[session_id] = _Held(lease, value)
        self._held.move_to_end(session_id)
        while len(self._held) > MAX_TRACKED_SESSIONS:
            self._held.popitem(last=False)


def _key(session_id: str) -> str:
    return f"sessions/{session_id}"
