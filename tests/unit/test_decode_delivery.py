"""The decode worker's delivery streams written from the engine thread: frames leave whole and
in order whether the client keeps up or not (the rest then goes through the event loop), the
flushing thread never blocks, and a write that fails ends the stream (its requests' later
chunks go on their Generate calls)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from kvmesh import event_loop
from kvmesh.mesh import frames
from kvmesh.proto.v1 import decode_pb2
from services.decode.delivery import Deliveries, DeliverySocket

CHUNKS = 150
TOKENS_PER_CHUNK = 20_000  # ~60 KB a frame: 9 MB in all, past the sender's socket buffer


def _chunk(index: int) -> decode_pb2.DecodeResponse:
    tokens = [100_000 + index] * TOKENS_PER_CHUNK
    return decode_pb2.DecodeResponse(request_id="r", token_ids=tokens, first_index=index)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_frames_flushed_from_another_thread_arrive_whole_and_in_order_to_a_slow_client(
    loop, monkeypatch
):
    monkeypatch.setenv("KVMESH_EVENT_LOOP", loop)

    async def run() -> tuple[list[int], float]:
        deliveries = Deliveries()
        server = DeliverySocket(deliveries)
        port = await server.start("127.0.0.1")
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that lags
        client.connect(("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=client)
        writer.write(frames.frame(decode_pb2.DeliverRequest(delivery_id="d")))
        while not deliveries.is_open("d"):
            await asyncio.sleep(0.01)
        took: list[float] = []

        def engine_thread() -> None:  # as the taps do after each step; nobody reads yet
            started = time.monotonic()
            for i in range(CHUNKS):
                assert deliveries.add("d", _chunk(i))
                deliveries.flush("d")
            took.append(time.monotonic() - started)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        got: list[int] = []
        while len(got) < CHUNKS:
            message = decode_pb2.DecodeResponses.FromString(
                await asyncio.wait_for(frames.read_frame(reader), 10)
            )
            for response in message.responses:
                index = response.first_index
                assert list(response.token_ids) == [100_000 + index] * TOKENS_PER_CHUNK
                got.append(index)
        writer.close()
        server.close()
        return got, took[0]

    got, took = event_loop.run(run())
    assert got == list(range(CHUNKS))
    assert took < 10  # it never waited for the client


def test_a_write_that_fails_ends_the_stream_and_later_chunks_are_refused():
    def broken(message: decode_pb2.DecodeResponses) -> None:
        raise BrokenPipeError("the gateway went away")

    deliveries = Deliveries()
    with deliveries.opened("d", broken):
        assert deliveries.add("d", _chunk(0))
        deliveries.flush("d")  # the failure is the stream's end, not the caller's error
        assert not deliveries.add("d", _chunk(1))  # so this one goes on its Generate call
    assert not deliveries.is_open("d")
