"""The gateway's end of decode delivery streams: one connection to each decode worker's delivery
socket (services/decode/delivery.py) carries the chunks of every request this gateway runs there,
one frame per engine step; each request's Generate call brings only its last chunk.
`Delivery.chunks` puts a request's chunks back in order from both (`first_index`: its tokens sent
before a chunk). The frames are read in the event loop itself (an asyncio.Protocol): no gRPC
threads hand them on."""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from kvmesh.mesh import frames
from kvmesh.proto.v1 import decode_pb2
from kvmesh.routing.router import WorkerUnavailable

log = structlog.get_logger(__name__)
_END = object()  # the Generate stream ended


class Delivery(asyncio.Protocol):
    """One open delivery stream to the decode worker whose delivery socket is `address`, and the
    requests it serves. `on_end` is called once when the stream ends (refused, broken, closed)."""

    def __init__(self, address: str, on_end: Callable[[Delivery], None] = lambda _: None) -> None:
        self.id = uuid.uuid4().hex
        self.address = address
        self._queues: dict[str, Inbox] = {}
        self._on_end = on_end
        self._frames = frames.FrameBuffer()
        self._transport: asyncio.BaseTransport | None = None
        self.broken = False
        self.connected = False  # False when it ends: the worker's socket refused it
        # its own context: its log lines are nobody's request's
        self._opening = asyncio.create_task(self._open(), context=contextvars.Context())

    def serves(self, request_id: str) -> bool:
        """Whether a request of this id runs on it now (a second one must not: chunks are
        routed by request id; it streams on its own call instead)."""
        return request_id in self._queues

    async def chunks(
        self, request_id: str, call: grpc.aio.UnaryStreamCall
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """The request's chunks in order, from this stream and its Generate `call`, up to the
        one that ends it; the call's errors, and an in-band error chunk, come as they arrive
        (tokens still in flight before them are dropped, as the request is over)."""
        if request_id in self._queues:  # the caller asks `serves` first
            raise ValueError(f"request {request_id!r} already runs on this delivery stream")
        queue = Inbox()
        self._queues[request_id] = queue
        pump = asyncio.create_task(_pump(call, queue))
        try:
            sent, held, last, broken = 0, {}, None, self.broken
            while True:
                while (arrival := queue.arrived()) is not None:
                    await arrival
                item = queue.take()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    broken = True
                elif item is _END:
                    if last is None:
                        raise WorkerUnavailable(
                            f"decode worker {self.address} ended a stream before its last chunk"
                        )
                elif item.HasField("error"):
                    yield item  # the request is over: raised by the caller
                    return
                elif item.token_ids or item.finish_reason:  # a chunk of nothing adds nothing
                    if item.first_index >= sent:
                        held.setdefault(item.first_index, item)
                    last = item if item.finish_reason else last
                while sent in held:
                    response = held.pop(sent)
                    yield response
                    if response.finish_reason:
                        return
                    sent += len(response.token_ids)
                # once the stream is gone only Generate's chunks come, in order: a gap stays
                if broken and held and min(held) > sent:
                    raise WorkerUnavailable(f"decode worker {self.address}: chunks lost")
        finally:
            pump.cancel()
            del self._queues[request_id]

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()  # connection_lost ends it
        elif self._opening.cancel():
            self._end()

    async def _open(self) -> None:
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")  # an IPv6 literal comes in brackets
        try:
            loop = asyncio.get_running_loop()
            await loop.create_connection(lambda: self, host, int(port))
        except (OSError, ValueError) as exc:
            log.warning("gateway.delivery_refused", address=self.address, error=repr(exc))
            self._end()

    def connection_made(self, transport) -> None:  # uvloop's is no asyncio.Transport subclass
        self._transport = transport
        self.connected = True
        frames.no_delay(transport)
        transport.write(frames.frame(decode_pb2.DeliverRequest(delivery_id=self.id)))

    def data_received(self, data: bytes) -> None:
        try:
            messages = [decode_pb2.DecodeResponses.FromString(f) for f in self._frames.feed(data)]
        except (frames.FrameError, DecodeError) as exc:
            log.warning("gateway.delivery_broken", address=self.address, error=repr(exc))
            self._transport.abort()  # type: ignore[union-attr]  (connection_lost ends it)
            return
        for message in messages:
            for response in message.responses:
                queue = self._queues.get(response.request_id)
                if queue is not None:  # else: the request is over (cancelled)
                    queue.put_nowait(response)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            log.warning("gateway.delivery_broken", address=self.address, error=repr(exc))
        self._end()

    def _end(self) -> None:
        if self.broken:
            return
        self.broken = True
        for queue in self._queues.values():
            queue.put_nowait(None)  # whatever was in flight on it may be lost
        self._on_end(self)


class Inbox:
    """What arrives for one request, in order: an unbounded queue with one waiter (a token's
    hand-over is one future, not asyncio.Queue's bookkeeping)."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def arrived(self) -> asyncio.Future | None:
        """None when an item is here; else a future done when one arrives (awaited by the
        reader itself: no coroutine of its own between the reader and the event loop)."""
        if self._items:
            return None
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def take(self) -> Any:
        self._waiter = None
        return self._items.popleft()


async def _pump(call: grpc.aio.UnaryStreamCall, queue: Inbox) -> None:
    try:
        async for response in call:
            queue.put_nowait(response)
        queue.put_nowait(_END)
    except Exception as exc:  # AioRpcError, mapped by the caller as before
        queue.put_nowait(exc)
