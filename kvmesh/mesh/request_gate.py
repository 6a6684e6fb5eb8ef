"""A worker's admission of requests: bounded (past `max_requests` a call is refused with
OverloadedError, so the gateway tries another worker or answers 429 instead of queueing without
end) and drained on SIGTERM (new calls refused with WorkerUnavailableError, so the gateway sends
them elsewhere, while the ones in flight finish within the drain timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

import structlog

from kvmesh.errors import OverloadedError, WorkerUnavailableError

log = structlog.get_logger(__name__)


class RequestGate:
    def __init__(
        self,
        max_requests: int = 0,
        on_change: Callable[[int], None] | None = None,
        holder: str = "the worker",
        flag: str = "--max-queued-requests",
    ) -> None:
        self.max_requests = max_requests  # 0: no bound
        self._limit = (holder, flag)  # named in the refusal
        self._on_change = on_change or (lambda _: None)  # told the count at each change
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one request for the `with` block; refused while draining or when full."""
        if self.draining:
            raise WorkerUnavailableError("the worker is draining (shutting down): retry elsewhere")
        if self.max_requests and self.in_flight >= self.max_requests:
            holder, flag = self._limit
            raise OverloadedError(f"{holder} holds {self.in_flight} requests, its limit ({flag})")
        self.in_flight += 1
        self._on_change(self.in_flight)
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._on_change(self.in_flight)
            if self.in_flight == 0:
                self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests; wait up to `timeout_s` for those in flight. Returns how many
        were still running (they end when the server stops: their streams migrate)."""
        self.draining = True
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        log.info(
            "worker.drained", left=self.in_flight, seconds=round(time.monotonic() - started, 3)
        )
        return self.in_flight
