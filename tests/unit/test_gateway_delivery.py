"""The gateway's end of a decode worker's delivery stream: a request's chunks put back in order
from both streams, and a broken stream or a Generate call ending early raised, never waited on."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.proto.v1 import common_pb2, decode_pb2
from services.gateway.delivery import Delivery
from services.gateway.router import WorkerUnavailable


class _Stream:
    """An RPC's response stream fed by the test; `fail()` ends it as a broken connection."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def put(self, item) -> None:
        self.queue.put_nowait(item)

    def end(self) -> None:
        self.queue.put_nowait(None)

    def cancel(self) -> None:
        self.cancelled = True
        self.end()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


class _Stub:
    def __init__(self) -> None:
        self.deliver = _Stream()

    def Deliver(self, request):  # noqa: N802 (the gRPC method's name)
        self.delivery_id = request.delivery_id
        return self.deliver


def _chunk(first: int, tokens: list[int], last: bool = False) -> decode_pb2.DecodeResponse:
    chunk = decode_pb2.DecodeResponse(request_id="r", token_ids=tokens, first_index=first)
    if last:
        chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
    return chunk


async def _collect(delivery: Delivery, call: _Stream) -> list[int]:
    tokens: list[int] = []
    async for chunk in delivery.chunks("r", call):
        tokens += chunk.token_ids
    return tokens


def test_chunks_from_both_streams_come_out_in_order():
    async def run() -> list[int]:
        stub, call = _Stub(), _Stream()
        delivery = Delivery(stub, "decode:1")
        task = asyncio.create_task(_collect(delivery, call))
        await asyncio.sleep(0)
        call.put(_chunk(0, [10]))  # before the delivery stream was open on the worker
        call.put(_chunk(4, [14], last=True))  # the last chunk overtakes two delivered ones
        call.end()
        await asyncio.sleep(0)
        other = decode_pb2.DecodeResponse(request_id="gone", token_ids=[99], first_index=0)
        stub.deliver.put(decode_pb2.DecodeResponses(responses=[_chunk(2, [12, 13]), other]))
        stub.deliver.put(decode_pb2.DecodeResponses(responses=[_chunk(1, [11])]))
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(run()) == [10, 11, 12, 13, 14]


def test_a_broken_delivery_stream_fails_the_request_instead_of_waiting():
    async def run() -> None:
        stub, call = _Stub(), _Stream()
        delivery = Delivery(stub, "decode:1")
        task = asyncio.create_task(_collect(delivery, call))
        await asyncio.sleep(0)
        stub.deliver.put(decode_pb2.DecodeResponses(responses=[_chunk(0, [10])]))
        reset = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details="stream reset")
        stub.deliver.put(reset)  # chunk 1 lost with it
        call.put(_chunk(2, [12], last=True))
        call.end()
        await asyncio.wait_for(task, 5)

    with pytest.raises(WorkerUnavailable, match="lost"):
        asyncio.run(run())


def test_all_chunks_on_generate_still_work_when_the_delivery_stream_is_gone():
    async def run() -> list[int]:
        stub, call = _Stub(), _Stream()
        delivery = Delivery(stub, "decode:1")
        stub.deliver.end()  # the worker closed it: it sends everything on Generate
        await asyncio.sleep(0)
        for chunk in (_chunk(0, [10]), _chunk(1, [11]), _chunk(2, [12], last=True)):
            call.put(chunk)
        call.end()
        return await asyncio.wait_for(_collect(delivery, call), 5)

    assert asyncio.run(run()) == [10, 11, 12]


def test_a_generate_stream_ending_without_its_last_chunk_is_an_error():
    async def run() -> None:
        stub, call = _Stub(), _Stream()
        delivery = Delivery(stub, "decode:1")
        call.put(_chunk(0, [10]))
        call.end()
        await asyncio.wait_for(_collect(delivery, call), 5)

    with pytest.raises(WorkerUnavailable, match="before its last chunk"):
        asyncio.run(run())


def test_an_error_chunk_ends_the_request_at_once_and_empty_chunks_add_nothing():
    async def run() -> list:
        stub, call = _Stub(), _Stream()
        delivery = Delivery(stub, "decode:1")
        got: list = []

        async def collect() -> None:
            got.extend([c async for c in delivery.chunks("r", call)])

        task = asyncio.create_task(collect())
        await asyncio.sleep(0)
        call.put(_chunk(0, [10]))
        call.put(_chunk(1, []))  # nothing new: skipped, not held in the way of index 1
        stub.deliver.put(decode_pb2.DecodeResponses(responses=[_chunk(1, [11])]))
        await asyncio.sleep(0.01)
        failed = decode_pb2.DecodeResponse(request_id="r", first_index=5)
        failed.error.message = "engine failed"
        call.put(failed)  # chunks 2-4 still in flight: dropped, the request is over
        await asyncio.wait_for(task, 5)
        return got

    chunks = asyncio.run(run())
    assert [list(c.token_ids) for c in chunks] == [[10], [11], []]
    assert chunks[-1].error.message == "engine failed"


def test_a_second_request_of_the_same_id_is_refused_without_disturbing_the_first():
    async def run() -> tuple[list[int], bool]:
        stub, first_call = _Stub(), _Stream()
        ended: list[Delivery] = []
        delivery = Delivery(stub, "decode:1", ended.append)
        first = asyncio.create_task(_collect(delivery, first_call))
        await asyncio.sleep(0)
        assert delivery.serves("r")  # the backend then streams a second "r" on its own call
        with pytest.raises(ValueError, match="already runs"):
            await anext(delivery.chunks("r", _Stream()))
        stub.deliver.put(decode_pb2.DecodeResponses(responses=[_chunk(0, [10])]))
        first_call.put(_chunk(1, [11], last=True))
        first_call.end()
        tokens = await asyncio.wait_for(first, 5)
        stub.deliver.end()
        await asyncio.sleep(0.01)
        return tokens, ended == [delivery] and not delivery.serves("r")

    tokens, ended = asyncio.run(run())
    assert tokens == [10, 11]
    assert ended
