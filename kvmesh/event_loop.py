"""How a service process runs: its main coroutine on uvloop where it is installed (libuv's loop
spends a fraction of the standard loop's CPU per wake-up, and a streamed token wakes the decode
worker, the gateway and the client once each), else on asyncio's own loop
(`KVMESH_EVENT_LOOP=asyncio`); and, once it is ready, its start-up heap out of the garbage
collector's way."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvmesh import env

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None for asyncio's default."""
    if env.event_loop() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop loop_factory picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now (modules, model, tokenizer) from later
    collections: a full collection otherwise walks them all (tens of ms, inside a decode step or
    between a gateway's tokens), and every young one pays for the survivors it promotes."""
    gc.collect()
    gc.freeze()
