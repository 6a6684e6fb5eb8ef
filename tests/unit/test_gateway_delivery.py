"""The gateway's end of a decode worker's delivery stream: a request's chunks put back in order
from both streams, and a broken stream or a Generate call ending early raised, never waited on."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh import event_loop
from kvmesh.mesh import frames
from kvmesh.proto.v1 import common_pb2, decode_pb2
from kvmesh.routing.router import WorkerUnavailable
from services.decode.delivery import Deliveries, DeliverySocket
from services.gateway.delivery import Delivery, Inbox


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


class _Socket:
    """A decode worker's delivery socket, played by the test: it takes the hello, then writes
    the frames it is given; `fail()` resets the connection, `end()` closes it."""

    async def start(self) -> str:
        self.connected = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hello = decode_pb2.DeliverRequest.FromString(await frames.read_frame(reader))
        self.writer = writer
        self.connected.set()

    def put(self, *responses: decode_pb2.DecodeResponse) -> None:
        self.writer.write(frames.frame(decode_pb2.DecodeResponses(responses=responses)))

    def fail(self) -> None:
        self.writer.transport.abort()

    def end(self) -> None:
        self.writer.close()


async def _open(on_end=lambda _: None) -> tuple[_Socket, Delivery]:
    socket = _Socket()
    delivery = Delivery(await socket.start(), on_end)
    await asyncio.wait_for(socket.connected.wait(), 5)
    assert socket.hello.delivery_id == delivery.id
    return socket, delivery


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
        (socket, delivery), call = await _open(), _Stream()
        task = asyncio.create_task(_collect(delivery, call))
        await asyncio.sleep(0)
        call.put(_chunk(0, [10]))  # before the delivery stream was open on the worker
        call.put(_chunk(4, [14], last=True))  # the last chunk overtakes two delivered ones
        call.end()
        await asyncio.sleep(0)
        other = decode_pb2.DecodeResponse(request_id="gone", token_ids=[99], first_index=0)
        socket.put(_chunk(2, [12, 13]), other)
        socket.put(_chunk(1, [11]))
        return await asyncio.wait_for(task, 5)

    assert event_loop.run(run()) == [10, 11, 12, 13, 14]


def test_a_broken_delivery_stream_fails_the_request_instead_of_waiting():
    async def run() -> None:
        (socket, delivery), call = await _open(), _Stream()
        task = asyncio.create_task(_collect(delivery, call))
        await asyncio.sleep(0)
        socket.put(_chunk(0, [10]))
        await asyncio.sleep(0.01)
        socket.fail()  # chunk 1 lost with it
        await asyncio.sleep(0.01)
        call.put(_chunk(2, [12], last=True))
        call.end()
        await asyncio.wait_for(task, 5)

    with pytest.raises(WorkerUnavailable, match="lost"):
        event_loop.run(run())


def test_all_chunks_on_generate_still_work_when_the_delivery_stream_is_gone():
    async def run() -> list[int]:
        (socket, delivery), call = await _open(), _Stream()
        socket.end()  # the worker closed it: it sends everything on Generate
        await asyncio.sleep(0.01)
        assert delivery.broken
        for chunk in (_chunk(0, [10]), _chunk(1, [11]), _chunk(2, [12], last=True)):
            call.put(chunk)
        call.end()
        return await asyncio.wait_for(_collect(delivery, call), 5)

    assert event_loop.run(run()) == [10, 11, 12]


def test_a_generate_stream_ending_without_its_last_chunk_is_an_error():
    async def run() -> None:
        (_, delivery), call = await _open(), _Stream()
        call.put(_chunk(0, [10]))
        call.end()
        await asyncio.wait_for(_collect(delivery, call), 5)

    with pytest.raises(WorkerUnavailable, match="before its last chunk"):
        event_loop.run(run())


def test_an_error_chunk_ends_the_request_at_once_and_empty_chunks_add_nothing():
    async def run() -> list:
        (socket, delivery), call = await _open(), _Stream()
        got: list = []

        async def collect() -> None:
            got.extend([c async for c in delivery.chunks("r", call)])

        task = asyncio.create_task(collect())
        await asyncio.sleep(0)
        call.put(_chunk(0, [10]))
        call.put(_chunk(1, []))  # nothing new: skipped, not held in the way of index 1
        socket.put(_chunk(1, [11]))
        await asyncio.sleep(0.01)
        failed = decode_pb2.DecodeResponse(request_id="r", first_index=5)
        failed.error.message = "engine failed"
        call.put(failed)  # chunks 2-4 still in flight: dropped, the request is over
        await asyncio.wait_for(task, 5)
        return got

    chunks = event_loop.run(run())
    assert [list(c.token_ids) for c in chunks] == [[10], [11], []]
    assert chunks[-1].error.message == "engine failed"


def test_a_second_request_of_the_same_id_is_refused_without_disturbing_the_first():
    async def run() -> tuple[list[int], bool]:
        ended: list[Delivery] = []
        (socket, delivery), first_call = await _open(ended.append), _Stream()
        first = asyncio.create_task(_collect(delivery, first_call))
        await asyncio.sleep(0)
        assert delivery.serves("r")  # the backend then streams a second "r" on its own call
        with pytest.raises(ValueError, match="already runs"):
            await anext(delivery.chunks("r", _Stream()))
        socket.put(_chunk(0, [10]))
        await asyncio.sleep(0.01)
        first_call.put(_chunk(1, [11], last=True))
        first_call.end()
        tokens = await asyncio.wait_for(first, 5)
        socket.end()
        await asyncio.sleep(0.01)
        return tokens, ended == [delivery] and not delivery.serves("r")

    tokens, ended = event_loop.run(run())
    assert tokens == [10, 11]
    assert ended


def test_a_refused_connection_or_a_bad_frame_ends_the_stream_and_generate_carries_all():
    async def run() -> tuple[list[int], list[Delivery], bool]:
        ended: list[Delivery] = []
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        refused = Delivery(f"127.0.0.1:{port}", ended.append)  # nobody listens there now
        call = _Stream()
        for chunk in (_chunk(0, [10]), _chunk(1, [11], last=True)):
            call.put(chunk)
        call.end()
        tokens = await asyncio.wait_for(_collect(refused, call), 5)
        await asyncio.sleep(0.05)
        socket, garbled = await _open(ended.append)
        socket.writer.write(frames.HEADER.pack(frames.MAX_FRAME_BYTES + 1))  # not this protocol
        await asyncio.sleep(0.05)
        return tokens, ended, garbled.broken

    tokens, ended, garbled_broken = event_loop.run(run())
    assert tokens == [10, 11]
    assert len(ended) == 2 and garbled_broken
    assert [d.connected for d in ended] == [False, True]


def test_the_backend_tries_a_refused_delivery_socket_again_only_after_a_while(monkeypatch):
    from services.gateway import mesh_backend

    async def run() -> tuple[bool, bool, bool]:
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        address = f"127.0.0.1:{probe.sockets[0].getsockname()[1]}"
        probe.close()
        await probe.wait_closed()
        backend = mesh_backend.MeshBackend(router=None, model_name="m", max_model_len=64)
        first = backend._delivery(address)
        await asyncio.sleep(0.1)  # refused: ended
        held_back = first.broken and backend._delivery(address) is None
        now = time.monotonic()
        monkeypatch.setattr(mesh_backend, "_now", lambda: now + mesh_backend.REFUSED_RETRY_S + 1)
        again = backend._delivery(address)
        tried_again = again is not None and again is not first
        backend.close()
        return held_back, tried_again, backend._delivery("") is None

    assert event_loop.run(run()) == (True, True, True)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_workers_delivery_socket_streams_a_steps_chunks_and_forgets_a_client_that_left(
    loop, monkeypatch
):
    """services/decode DeliverySocket + Deliveries against the gateway's Delivery, on real
    sockets: one frame per loop turn's chunks, a duplicate id refused, a stranger turned away,
    and the stream unregistered when its client closes (later chunks go on Generate), on the
    services' loop (uvloop) and asyncio's."""
    monkeypatch.setenv("KVMESH_EVENT_LOOP", loop)

    async def run() -> tuple[list[int], bool, bool, bool]:
        deliveries = Deliveries()
        server = DeliverySocket(deliveries)
        port = await server.start("127.0.0.1")
        address = f"127.0.0.1:{port}"
        stranger_reader, stranger = await asyncio.open_connection("127.0.0.1", port)
        stranger.write(frames.HEADER.pack(1 << 20))  # a hello far over its limit
        stranger_turned_away = await asyncio.wait_for(stranger_reader.read(), 5) == b""
        delivery = Delivery(address)
        for _ in range(500):
            if deliveries.is_open(delivery.id):
                break
            await asyncio.sleep(0.01)
        twin = Delivery(address)
        twin.id = delivery.id  # before its hello goes out: the worker must refuse it
        call = _Stream()
        task = asyncio.create_task(_collect(delivery, call))
        await asyncio.sleep(0)
        assert deliveries.send(delivery.id, _chunk(0, [10]))
        assert deliveries.send(delivery.id, _chunk(1, [11, 12]))
        await asyncio.sleep(0.05)
        call.put(_chunk(3, [13], last=True))
        call.end()
        tokens = await asyncio.wait_for(task, 5)
        await asyncio.sleep(0.05)
        twin_refused = twin.broken and deliveries.is_open(delivery.id)
        delivery.close()
        for _ in range(500):
            if not deliveries.is_open(delivery.id):
                break
            await asyncio.sleep(0.01)
        forgotten = not deliveries.send(delivery.id, _chunk(4, [14]))
        server.close()
        return tokens, stranger_turned_away, twin_refused, forgotten

    tokens, stranger_turned_away, twin_refused, forgotten = event_loop.run(run())
    assert tokens == [10, 11, 12, 13]
    assert stranger_turned_away and twin_refused and forgotten


def test_an_inbox_hands_over_in_order_and_a_reader_cancelled_while_waiting_loses_nothing():
    async def run() -> list:
        inbox = Inbox()
        assert inbox.arrived() is not None  # empty: a future to wait on

        async def read(n: int) -> list:
            out = []
            for _ in range(n):
                while (arrival := inbox.arrived()) is not None:
                    await arrival
                out.append(inbox.take())
            return out

        waiting = asyncio.create_task(read(1))
        await asyncio.sleep(0)
        waiting.cancel()  # cancelled while it waits: what comes later stays for the next reader
        with pytest.raises(asyncio.CancelledError):
            await waiting
        reader = asyncio.create_task(read(3))
        await asyncio.sleep(0)
        for item in ("a", "b", "c"):
            inbox.put_nowait(item)
        return await asyncio.wait_for(reader, 5)

    assert event_loop.run(run()) == ["a", "b", "c"]
