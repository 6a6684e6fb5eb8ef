"""The services' event loop: uvloop by default, the standard loop on request, a clear error on a
misspelt choice."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from kvmesh import event_loop


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_uvloop_by_default(monkeypatch):
    monkeypatch.delenv("KVMESH_EVENT_LOOP", raising=False)
    assert event_loop.run(_loop_type()) is uvloop.Loop


def test_standard_loop_on_request(monkeypatch):
    monkeypatch.setenv("KVMESH_EVENT_LOOP", "asyncio")
    loop_type = event_loop.run(_loop_type())
    assert loop_type is not uvloop.Loop
    assert issubclass(loop_type, asyncio.BaseEventLoop)


def test_unknown_loop_is_refused(monkeypatch):
    monkeypatch.setenv("KVMESH_EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="uvloop or asyncio"):
        event_loop.loop_factory()


def test_freeze_heap_takes_the_live_heap_out_of_collections():
    import gc

    survivor = {"held": [object()]}  # alive across the freeze: never visited again
    try:
        event_loop.freeze_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is survivor for o in gc.get_objects())  # not in any generation
    finally:
        gc.unfreeze()
    assert any(o is survivor for o in gc.get_objects())
