"""Delivery streams of a decode worker: one per client, carrying the chunks of every request that
names it. The chunks of one engine step reach their requests' Generate handlers in one loop turn;
the stream's task runs after them and sends them as one message, so a gateway streaming 16
requests gets one message per step instead of 16.

A stream is served two ways: on the worker's delivery socket (`DeliverySocket`: length-prefixed
`DecodeResponses` frames on plain TCP, what the gateway uses, as Dynamo streams responses on a
TCP plane beside its request plane: no gRPC threads between the event loop and the socket) and as
the gRPC call `Decode.Deliver` for clients that speak only gRPC."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from google.protobuf.message import DecodeError

from kvmesh.errors import InvalidRequestError
from kvmesh.mesh import frames, metrics
from kvmesh.proto.v1 import decode_pb2

log = structlog.get_logger(__name__)
_HELLO_MAX_BYTES = 4096


class Deliveries:
    def __init__(self) -> None:
        self._open: dict[str, asyncio.Queue[decode_pb2.DecodeResponse]] = {}

    def is_open(self, delivery_id: str) -> bool:
        return delivery_id in self._open

    def send(self, delivery_id: str, response: decode_pb2.DecodeResponse) -> bool:
        """Queue `response` on the open stream `delivery_id`; False: none is open."""
        queue = self._open.get(delivery_id) if delivery_id else None
        if queue is None:
            return False
        queue.put_nowait(response)
        return True

    async def stream(self, delivery_id: str) -> AsyncIterator[decode_pb2.DecodeResponses]:
        """The stream's messages until the client leaves; each holds what was queued by then."""
        if not delivery_id:
            raise InvalidRequestError("delivery_id must be set")
        if delivery_id in self._open:
            raise InvalidRequestError(f"delivery stream {delivery_id!r} is already open")
        queue: asyncio.Queue[decode_pb2.DecodeResponse] = asyncio.Queue()
        self._open[delivery_id] = queue
        try:
            while True:
                responses = [await queue.get()]
                while not queue.empty():
                    responses.append(queue.get_nowait())
                yield decode_pb2.DecodeResponses(responses=responses)
        finally:
            del self._open[delivery_id]


class DeliverySocket:
    """The worker's delivery socket: a client connects, sends one `DeliverRequest` frame, then
    reads `DecodeResponses` frames until either end closes."""

    def __init__(self, deliveries: Deliveries) -> None:
        self.deliveries = deliveries
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> str:
        """Listen on `host:port` (0: a free port); returns the address to advertise."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()[1]
        return f"{host}:{bound}"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames.no_delay(writer.transport)
        sending = None
        try:
            hello = await asyncio.wait_for(frames.read_frame(reader, _HELLO_MAX_BYTES), 10)
            delivery_id = decode_pb2.DeliverRequest.FromString(hello).delivery_id
            sending = asyncio.create_task(self._send(delivery_id, writer))
            client_left = asyncio.create_task(reader.read())  # b"" at EOF; it sends no more
            await asyncio.wait({sending, client_left}, return_when=asyncio.FIRST_COMPLETED)
            client_left.cancel()
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, DecodeError) as exc:
            log.warning("decode.delivery_refused", error=repr(exc))  # not a delivery client
        finally:
            if sending is not None:
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sending
            writer.close()

    async def _send(self, delivery_id: str, writer: asyncio.StreamWriter) -> None:
        try:
            async for message in self.deliveries.stream(delivery_id):
                data = frames.frame(message)
                metrics.observe_message("decode", len(data))
                writer.write(data)
                await writer.drain()  # returns at once unless the client stopped reading
        except InvalidRequestError as exc:
            log.warning("decode.delivery_refused", error=str(exc))
        except (ConnectionError, OSError) as exc:
            log.info("decode.delivery_closed", error=repr(exc))
