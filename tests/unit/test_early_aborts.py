"""An abort that comes before the request it ends (issue 45, item 6): the Abort RPC overtook
the Generate / Prefill call, or the gateway was still routing. The request, arriving later,
ends at once with finish reason abort; it never reaches an engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.errors import RequestAbortedError
from kvmesh.proto.v1 import decode_pb2, prefill_pb2
from services.decode.worker import DecodeJob, DecodeWorker
from services.gateway.backend import GenerateChunk, GenerateInput
from services.gateway.mesh_backend import MeshBackend
from services.prefill.server import PrefillServicer
from services.prefill.worker import PrefillWorker


class _Engine:
    """An engine that holds no request; starting one fails the test."""

    kv_pages = SimpleNamespace(spec=SimpleNamespace(page_size=16, page_bytes=1024))
    max_model_len, page_io, faults = 256, None, None

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return False

    async def cancel_reservation(self, request_id: str) -> None:
        pass

    def _started(self, *args, **kwargs):
        raise AssertionError("an aborted request reached the engine")

    generate = commit = reserve = prefill = call = _started


@pytest.mark.parametrize("prefill_address", ["", "127.0.0.1:1"])  # local prefill, or remote
def test_a_decode_job_whose_abort_came_first_ends_at_once(prefill_address):
    engine = _Engine()
    worker = DecodeWorker(engine, "te", "fp32", local_prefill_tokens=0)  # type: ignore[arg-type]
    job = DecodeJob("r~1", [1, 2, 3], SamplingParams(max_tokens=2000), prefill_address)

    async def run() -> tuple[bool, list]:
        known = await worker.abort("r~1")
        return known, [out async for out in worker.generate(job)]

    known, outs = asyncio.run(run())
    assert not known and engine.aborted == ["r~1"]
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outs] == [
        ([], True, FinishReason.ABORT)
    ]
    other = DecodeJob("r~2", [1], SamplingParams(), prefill_address)
    with pytest.raises(AssertionError, match="reached the engine"):  # only that id
        asyncio.run(anext(worker.generate(other)))


def test_a_prefill_whose_abort_came_first_is_refused():
    """The decode worker's Abort reached the prefill worker before its Prefill call did (or
    while it read prefix pages): the prefill never starts, so the decode worker waiting for the
    call to end frees its reserved pages at once, not after a whole prefill and transfer."""
    engine = _Engine()
    transfer = SimpleNamespace(register=lambda address, length: None)
    worker = PrefillWorker(engine, transfer, "fp32")  # type: ignore[arg-type]

    async def run() -> None:
        abort = decode_pb2.AbortRequest(request_id="r~1")
        assert not (await PrefillServicer(worker, "p").Abort(abort, None)).aborted
        destination = prefill_pb2.KvDestination(
            page_ids=[0], page_bytes=1024, page_size=16, kv_dtype="fp32"
        )
        await worker.prefill("r~1", [1, 2, 3], SamplingParams(), destination)

    with pytest.raises(RequestAbortedError, match="aborted"):
        asyncio.run(run())


class _Router:
    def __init__(self) -> None:
        self.picked: list[str] = []

    def pick(self, role: str, *args, **kwargs):
        self.picked.append(role)
        raise AssertionError("an aborted request was routed")


class _Sessions:
    """A session lookup that waits (a store round trip) until `answer` is set."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    async def lookup(self, session_id: str) -> None:
        await self.answer.wait()


def test_a_request_aborted_on_the_gateway_before_its_first_leg_is_never_routed():
    router, sessions = _Router(), None

    async def run() -> list[GenerateChunk]:
        nonlocal sessions
        sessions = _Sessions()
        backend = MeshBackend(router, "m", 64, sessions)  # type: ignore[arg-type]
        request = GenerateInput("r.1", [1, 2, 3], SamplingParams(max_tokens=2000), "session")
        task = asyncio.create_task(_chunks(backend.generate(request)))
        await asyncio.sleep(0.05)  # it waits for its session's pin
        await backend.abort("r.1")
        sessions.answer.set()
        chunks = await task
        await backend.abort("r.1")  # over: nothing to do, nothing kept
        assert not backend._where and not backend._aborted
        return chunks

    assert asyncio.run(run()) == [GenerateChunk(finish_reason="abort")]
    assert router.picked == []


async def _chunks(stream) -> list[GenerateChunk]:
    return [chunk async for chunk in stream]
