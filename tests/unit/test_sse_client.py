"""The benchmarks' streaming client against a raw HTTP server that writes exactly the bytes a test
gives it: chunked and length-delimited bodies, events split anywhere, errors before and inside
the stream, a connection that ends early."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from kvmesh import event_loop
from kvmesh.errors import ServeBenchError
from kvmesh_apps.benchmarks.sse_client import post_events


def _chunked(parts: Sequence[bytes]) -> list[bytes]:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return [head] + [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]


async def _serve_and_post(writes: list[bytes], close_early: bool = False):
    """Starts a server that reads the request, then sends `writes` one by one; posts to it."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        for data in writes:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.01)
        if close_early:
            writer.transport.abort()
            return
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    events: list[dict] = []
    try:
        await post_events(
            f"http://127.0.0.1:{port}/v1/completions",
            {"prompt": "x"},
            {"Authorization": "Bearer k"},
            events.append,
            timeout_s=10,
        )
    finally:
        server.close()
    return events, seen


def test_events_split_anywhere_come_out_whole_and_in_order():
    stream = (
        b'data: {"n": 1}\r\n\r\ndata: {"n": 2}\n\n: a comment\n\ndata: {"n": 3}\n\ndata: [DONE]\n\n'
    )
    parts = [stream[i : i + 7] for i in range(0, len(stream), 7)]  # cut mid-line and mid-JSON
    events, seen = event_loop.run(_serve_and_post(_chunked(parts)))
    assert events == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer k\r\n" in seen[0]


def test_a_body_of_known_length_without_done_ends_the_stream():
    body = b'data: {"n": 1}\n\n'
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    events, _ = event_loop.run(_serve_and_post([head, body]))
    assert events == [{"n": 1}]


def test_an_http_error_raises_with_its_body():
    body = b'{"error": {"message": "max_tokens must be at least 1"}}'
    head = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(body)
    with pytest.raises(ServeBenchError, match="HTTP 400 .*max_tokens must be at least 1"):
        event_loop.run(_serve_and_post([head, body]))


def test_an_in_band_error_event_raises():
    parts = [b'data: {"n": 1}\n\n', b'data: {"error": {"message": "worker died"}}\n\n']
    with pytest.raises(ServeBenchError, match="in-band error.*worker died"):
        event_loop.run(_serve_and_post(_chunked(parts)))


def test_a_connection_that_ends_mid_stream_raises():
    writes = _chunked([b'data: {"n": 1}\n\n'])[:-1]  # no last chunk, no [DONE]
    with pytest.raises(ServeBenchError, match="ended before the stream did"):
        event_loop.run(_serve_and_post(writes, close_early=True))


def test_an_event_that_is_not_json_raises():
    with pytest.raises(ServeBenchError, match="not JSON"):
        event_loop.run(_serve_and_post(_chunked([b"data: {oops\n\n"])))


def test_a_status_line_without_a_reason_phrase_and_a_body_ended_by_closing():
    head = b"HTTP/1.1 200\r\ncontent-type: text/event-stream\r\n\r\n"  # no length, no chunks
    events, _ = event_loop.run(
        _serve_and_post([head, b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n'])
    )
    assert events == [{"n": 1}, {"n": 2}]


def test_an_error_body_ended_by_closing_keeps_its_status_and_text():
    writes = [b"HTTP/1.1 503 Service Unavailable\r\n\r\n", b"no decode worker"]
    with pytest.raises(ServeBenchError, match="HTTP 503 .*no decode worker"):
        event_loop.run(_serve_and_post(writes))


def test_the_callers_own_error_comes_out_as_it_is():
    async def post() -> None:
        server = await asyncio.start_server(
            _reply(_chunked([b'data: {"n": 1}\n\n'])), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]

        def on_event(chunk: dict) -> None:
            raise KeyError("the caller's bug")

        try:
            await post_events(f"http://127.0.0.1:{port}/", {}, {}, on_event, timeout_s=10)
        finally:
            server.close()

    with pytest.raises(KeyError, match="the caller's bug"):
        event_loop.run(post())
    with pytest.raises(ServeBenchError, match="not a JSON object"):
        event_loop.run(_serve_and_post(_chunked([b"data: [1, 2]\n\n"])))


def _reply(writes: list[bytes]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for data in writes:
            writer.write(data)
        await writer.drain()
        writer.close()

    return handle
