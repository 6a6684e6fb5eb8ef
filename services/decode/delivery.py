"""Delivery streams of a decode worker: one per client, carrying the chunks of every request that
names it. The engine's outputs of one step reach the loop in one callback, where each request's
tap (its Generate handler's, output_streams.py) adds its chunk to the stream; the next loop turn
sends them as one message, so a gateway streaming 16 requests gets one message per step instead
of 16, and no task wakes per token.

A stream is served two ways: on the worker's delivery socket (`DeliverySocket`: length-prefixed
`DecodeResponses` frames on plain TCP, what the gateway uses, as Dynamo streams responses on a
TCP plane beside its request plane: no gRPC threads between the event loop and the socket) and as
the gRPC call `Decode.Deliver` for clients that speak only gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable

import structlog
from google.protobuf.message import DecodeError

from kvmesh.errors import InvalidRequestError
from kvmesh.mesh import frames, metrics
from kvmesh.proto.v1 import decode_pb2

log = structlog.get_logger(__name__)
_HELLO_MAX_BYTES = 4096


class Deliveries:
    """The open delivery streams by id. `add` puts a chunk in one and `flush` sends what it
    holds as one message: the engine thread does both for a step's chunks (output_streams.py
    taps), so a gateway streaming 16 requests gets one message per step, and the worker's event
    loop does not wake per token."""

    def __init__(self) -> None:
        self._open: dict[str, _Outbox] = {}

    def is_open(self, delivery_id: str) -> bool:
        return delivery_id in self._open

    def add(self, delivery_id: str, response: decode_pb2.DecodeResponse) -> bool:
        """Any thread: put `response` in the open stream `delivery_id`; False: none is open."""
        outbox = self._open.get(delivery_id) if delivery_id else None
        return outbox is not None and outbox.add(response)

    def flush(self, delivery_id: str) -> None:
        outbox = self._open.get(delivery_id)
        if outbox is not None:
            outbox.flush()

    def send(self, delivery_id: str, response: decode_pb2.DecodeResponse) -> bool:
        """add + flush."""
        if not self.add(delivery_id, response):
            return False
        self.flush(delivery_id)
        return True

    @contextlib.contextmanager
    def opened(
        self,
        delivery_id: str,
        write: Callable[[decode_pb2.DecodeResponses], None],
        close: Callable[[], None] = lambda: None,
    ):
        """Stream `delivery_id` is open inside the block. `write` gets each message on the
        thread that flushes it, under the stream's lock; an OSError from it ends the stream.
        `close` runs under the same lock as the block ends."""
        if not delivery_id:
            raise InvalidRequestError("delivery_id must be set")
        if delivery_id in self._open:
            raise InvalidRequestError(f"delivery stream {delivery_id!r} is already open")
        outbox = self._open[delivery_id] = _Outbox(write)
        try:
            yield
        finally:
            del self._open[delivery_id]
            outbox.close(close)

    async def stream(self, delivery_id: str) -> AsyncIterator[decode_pb2.DecodeResponses]:
        """The stream's messages until the client leaves (the gRPC `Deliver` call)."""
        loop = asyncio.get_running_loop()
        messages: asyncio.Queue[decode_pb2.DecodeResponses] = asyncio.Queue()
        with self.opened(delivery_id, lambda m: loop.call_soon_threadsafe(messages.put_nowait, m)):
            while True:
                yield await messages.get()


class _Outbox:
    def __init__(self, write: Callable[[decode_pb2.DecodeResponses], None]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._pending: list[decode_pb2.DecodeResponse] = []
        self._closed = False

    def add(self, response: decode_pb2.DecodeResponse) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._pending.append(response)
            return True

    def flush(self) -> None:
        with self._lock:
            if self._closed or not self._pending:
                return
            message = decode_pb2.DecodeResponses(responses=self._pending)
            self._pending = []
            try:
                self._write(message)
            except OSError as exc:  # the client is gone: its requests' chunks go on their calls
                log.info("decode.delivery_closed", error=repr(exc))
                self._closed = True

    def close(self, then: Callable[[], None]) -> None:
        with self._lock:
            self._closed = True
            then()


class DeliverySocket:
    """The worker's delivery socket: a client connects, sends one `DeliverRequest` frame, then
    reads `DecodeResponses` frames until either end closes."""

    def __init__(self, deliveries: Deliveries) -> None:
        self.deliveries = deliveries
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on `host:port` (0: a free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames.no_delay(writer.transport)
        try:
            hello = await asyncio.wait_for(frames.read_frame(reader, _HELLO_MAX_BYTES), 10)
            delivery_id = decode_pb2.DeliverRequest.FromString(hello).delivery_id
            sink = _SocketSink(writer)
            try:
                with self.deliveries.opened(delivery_id, sink.write, sink.close):
                    await reader.read()  # b"" at EOF (it sends no more), or the connection broke
            finally:
                sink.close()  # again, harmless; or refused (a duplicate id) before it was open
        except InvalidRequestError as exc:
            log.warning("decode.delivery_refused", error=str(exc))
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, DecodeError) as exc:
            log.warning("decode.delivery_refused", error=repr(exc))  # not a delivery client
        finally:
            writer.close()


class _SocketSink:
    """Frames sent from the thread that flushes them (the engine thread) on the connection's own
    descriptor, without blocking: a client that stopped reading gets the rest through the event
    loop's transport, which buffers it, and every later frame the same way, in order."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._loop = asyncio.get_running_loop()
        self._writer = writer
        fd = writer.get_extra_info("socket").fileno()
        self._sock = socket.socket(fileno=os.dup(fd))  # O_NONBLOCK is shared with the loop's
        self._via_loop = False

    def write(self, message: decode_pb2.DecodeResponses) -> None:  # under the outbox lock
        data = frames.frame(message)
        metrics.observe_message("decode", len(data))
        if not self._via_loop:
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            data, self._via_loop = data[sent:], True
        self._loop.call_soon_threadsafe(self._write_on_loop, data)

    def _write_on_loop(self, data: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(data)

    def close(self) -> None:  # under the outbox lock: no send is using the descriptor
        self._sock.close()
