"""Delivery streams of a decode worker (`Decode.Deliver`): one per client, carrying the chunks
of every request that names it. The chunks of one engine step reach their requests' Generate
handlers in one loop turn; the stream's task runs after them and sends them as one message, so a
gateway streaming 16 requests gets one gRPC message per step instead of 16."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvmesh.errors import InvalidRequestError
from kvmesh.proto.v1 import decode_pb2


class Deliveries:
    def __init__(self) -> None:
        self._open: dict[str, asyncio.Queue[decode_pb2.DecodeResponse]] = {}

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
