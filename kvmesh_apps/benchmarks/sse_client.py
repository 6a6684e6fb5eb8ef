"""The serving benchmarks' streaming request: one HTTP/1.1 connection per request, the response
parsed by httptools inside the event loop's data callback and each server-sent event's JSON handed
to a callback as it arrives. No task wakes up per token and no stream object sits between the
socket and the callback: the client shares the server's cores, and every microsecond it spends
per token is taken from the server's steps (aiohttp's streamed reads cost ~0.18 ms a token here,
most of it cold Python between its parser and the reader)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson

from kvmesh.errors import ServeBenchError

OnEvent = Callable[[dict[str, Any]], None]


async def post_events(
    url: str, body: dict[str, Any], headers: dict[str, str], on_event: OnEvent, timeout_s: float
) -> None:
    """POST `body` as JSON to `url`; `on_event` gets each `data:` JSON of the event stream, up to
    `data: [DONE]` or the response's end. Raises ServeBenchError for a status other than 200 (with
    the body), an in-band error event, a malformed response or a connection that ends early."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServeBenchError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    data = orjson.dumps(body)
    host = parts.hostname + (f":{parts.port}" if parts.port else "")  # never the URL's credentials
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(data)}",
        "Connection: close",
    ]
    head += [f"{name}: {value}" for name, value in headers.items()]
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    async with asyncio.timeout(timeout_s):
        transport, _ = await loop.create_connection(
            lambda: _EventStream(url, done, on_event),
            parts.hostname,
            port,
            ssl=True if parts.scheme == "https" else None,
        )
        try:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + data)
            await done
        finally:
            if not done.done():
                done.cancel()  # what closing reports then goes nowhere
            transport.close()


class _EventStream(asyncio.Protocol):
    """One response: its status, then its body's events (httptools undoes chunked encoding; a
    body with neither a length nor chunks ends with the connection)."""

    def __init__(self, url: str, done: asyncio.Future[None], on_event: OnEvent) -> None:
        self._url = url
        self._done = done
        self._on_event = on_event
        self._parser = httptools.HttpResponseParser(self)
        self._status = 0
        self._delimited = False  # by a length or chunks; else the connection's end ends the body
        self._pending = b""  # an event not yet complete
        self._error_body = bytearray()

    def data_received(self, data: bytes) -> None:
        if self._done.done():
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"a malformed response from {self._url}: {exc!r}")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._status and not self._delimited:
            self.on_message_complete()
        self._fail(f"the connection to {self._url} ended before the stream did ({exc!r})")

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._delimited = True

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()  # (no on_status without a reason phrase)

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            self._error_body += body
            return
        events = (self._pending + body).replace(b"\r\n", b"\n").split(b"\n\n")
        self._pending = events.pop()
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:") or self._done.done():
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self._done.set_result(None)
                    continue
                self._event(payload)

    def _event(self, payload: bytes) -> None:
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            return self._fail(f"an event that is not JSON from {self._url}: {exc}")
        if not isinstance(chunk, dict):
            return self._fail(f"an event that is not a JSON object from {self._url}: {chunk!r}")
        if "error" in chunk:
            return self._fail(f"in-band error: {chunk['error']}")
        try:
            self._on_event(chunk)
        except Exception as exc:  # the caller's own error, as it is (httptools would wrap it)
            self._done.set_exception(exc)

    def on_message_complete(self) -> None:
        if self._status != 200:
            text = self._error_body.decode(errors="replace")
            self._fail(f"HTTP {self._status} from {self._url}: {text}")
        elif not self._done.done():
            self._done.set_result(None)  # a server that ends the body without [DONE]

    def _fail(self, message: str) -> None:
        if not self._done.done():
            self._done.set_exception(ServeBenchError(message))
