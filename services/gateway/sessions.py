"""Session affinity state in etcd: /kvmesh/<cluster>/sessions/<id> -> the (prefill, decode) pair,
on a lease that every use renews."""

from __future__ import annotations

import json
from dataclasses import dataclass

import structlog

from kvmesh.errors import KvmeshError
from kvmesh.mesh.discovery import Registry

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Pin:
    """The workers a session is pinned to; prefill may be empty (decode prefills itself)."""

    prefill: str
    decode: str


class SessionStore:
    def __init__(self, registry: Registry, ttl: int = 600) -> None:
        self.registry = registry
        self.ttl = ttl

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
        """Store (or renew) the pin on a fresh lease of `ttl` seconds."""
        value = json.dumps({"prefill": pin.prefill, "decode": pin.decode}).encode()
        try:
            await self.registry.put(_key(session_id), value, ttl=self.ttl)
        except KvmeshError as exc:
            log.warning("sessions.pin_failed", error=str(exc))


def _key(session_id: str) -> str:
    return f"sessions/{session_id}"
