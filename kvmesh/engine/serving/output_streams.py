"""A request's outputs on their way from the engine thread to its asyncio caller.

After each step the engine thread offers every output to its request's `OutputStream`. A stream
whose caller gave a `Tap` hands it to the tap right there, on the engine thread; what no tap
takes reaches the caller's event loop in one callback per step (`put_all`) and comes out of
`drain`. A tap is how a worker forwards a step's tokens to a socket without waking its event
loop: where cores are few, that wake-up is CPU taken from the next step, and the loop's Python
then contends for the GIL with the engine thread's own work between steps (measured:
docs/benchmarks-history.md, "Tokens leave from the engine thread, and a CPU of its own for the
decode engine thread").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import structlog

from kvmesh.engine.core.engine import TokenOutput

log = structlog.get_logger(__name__)


class Tap(Protocol):
    """Takes a request's outputs on the engine thread, right after the step that made them and
    outside the engine lock: quick, never blocking, never touching the engine. `take` is offered,
    in order, each output that neither ends the request nor carries an error; True: taken (the
    stream never yields it). Once it declines one (or raises) it is not asked again: that output
    and every later one come in order from `drain`. `flush` runs after the step's outputs were
    all offered, for every tap that took one."""

    def take(self, out: TokenOutput) -> bool: ...

    def flush(self) -> None: ...


class OutputStream:
    def __init__(self, loop: asyncio.AbstractEventLoop, tap: Tap | None = None) -> None:
        self.loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tap = tap
        self.ended = False  # drain took the last output or an error: nothing more comes
        # aborted (set on any thread): the request must not start if it has not (AsyncEngine)
        self.aborted = False

    def offer(self, item: Any) -> Tap | None:
        """Engine thread: the tap that took `item`, or None (then `put` it on the loop)."""
        tap = self._tap
        if tap is None or not _joinable(item):
            return None
        try:
            if tap.take(item):
                return tap
        except Exception:  # a broken tap must not lose the output (nor the step's others)
            log.exception("engine.output_tap_failed", request_id=item.request_id)
        self._tap = None
        return None

    def put(self, item: Any) -> None:
        """On the loop: a TokenOutput, or an exception that ends the stream."""
        self._queue.put_nowait(item)

    async def drain(self) -> AsyncIterator[TokenOutput]:
        """The outputs no tap took, up to the last; raises an error output's error. A consumer
        that fell behind gets what piled up as one output (fewer messages)."""
        queue = self._queue
        held: Any = None  # an item taken while coalescing that could not join the one before
        while True:
            item, held = (held, None) if held is not None else (await queue.get(), None)
            while _joinable(item) and not queue.empty():
                following = queue.get_nowait()
                if not _joinable(following) and not _final(following):
                    held = following
                    break
                item = item.followed_by(following)
            if isinstance(item, BaseException):
                self.ended = True
                raise item
            self.ended = item.finished
            if item.error is not None:
                raise item.error
            yield item
            if item.finished:
                return


def flush_all(taps: list[Tap]) -> None:
    """Engine thread: flush each tap that took an output of the step, once."""
    for tap in {id(t): t for t in taps}.values():
        try:
            tap.flush()
        except Exception:
            log.exception("engine.output_tap_flush_failed")


def put_all(items: list[tuple[OutputStream, Any]]) -> None:
    """On the loop: one step's untapped outputs for it, in order (one wake-up per step)."""
    for stream, item in items:
        stream.put(item)


def _joinable(item: Any) -> bool:
    """An output more tokens may follow in one message: not an error, not the last."""
    return isinstance(item, TokenOutput) and not item.finished and item.error is None


def _final(item: Any) -> bool:
    """A clean last output: it may close a coalesced run."""
    return isinstance(item, TokenOutput) and item.finished and item.error is None
