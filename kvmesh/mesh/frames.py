"""Length-prefixed protobuf messages on a plain TCP connection: the decode worker's delivery
socket (services/decode/delivery.py, services/gateway/delivery.py). Each frame is a 4-byte
little-endian length, then that many bytes of one serialized message."""

from __future__ import annotations

import asyncio
import socket
import struct

from google.protobuf.message import Message

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 64 << 20  # a step's chunks of 64 streams with logprobs are ~100 KB


class FrameError(ValueError):
    """A frame larger than its reader allows: the peer is not speaking this protocol."""


def frame(message: Message) -> bytes:
    data = message.SerializeToString()
    return HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes over the limit of {max_bytes}")
    return await reader.readexactly(size)


class FrameBuffer:
    """Bytes as they arrive in, whole frames out (for an asyncio.Protocol's data_received)."""

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max_bytes = max_bytes

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        frames, start, end = [], 0, len(buffer)
        while end - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            if size > self._max_bytes:
                raise FrameError(f"frame of {size} bytes over the limit of {self._max_bytes}")
            if end - start - HEADER.size < size:
                break
            start += HEADER.size
            frames.append(bytes(buffer[start : start + size]))
            start += size
        del buffer[:start]
        return frames


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Send each frame at once (a chunk per engine step must not wait for Nagle's timer)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
