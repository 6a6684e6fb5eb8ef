"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same
backend, tokenizer and generation as the OpenAI routes. Streaming sends the complete event
sequence: message_start, per block content_block_start / *_delta / content_block_stop (text
blocks, and tool_use blocks whose input arrives as input_json_delta), message_delta with the
stop reason and usage, message_stop; errors in Anthropic's JSON shape, in-band once streaming."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import structlog
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvmesh.agent.partial_json import partial_json
from kvmesh.agent.tool_parsers import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
    parse_output,
)
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.mesh.error_mapping import anthropic_error_body, http_headers, http_status
from services.gateway.anthropic_protocol import count_tokens, parse_messages
from services.gateway.backend import GenerateBackend
from services.gateway.generation import Delta, Generation, Routing
from services.gateway.openai_protocol import ParsedRequest
from services.gateway.served import ServedModel

log = structlog.get_logger(__name__)
_STOP = {"length": "max_tokens", "abort": "end_turn"}


class AnthropicApi:
    def __init__(
        self, backend: GenerateBackend, tokenizer: Tokenizer, served: ServedModel, read_json
    ) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._served = served
        self._read_json = read_json  # (request) -> body, with the gateway's size limit

    async def count_tokens(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            count = await run_in_threadpool(count_tokens, body, self._tokenizer, self._served)
        except Exception as exc:
            return _error(exc)
        return JSONResponse({"input_tokens": count})

    async def messages(self, request: Request) -> Response:
        request_id: str = request.state.request_id
        started = time.monotonic()
        try:
            body = await self._read_json(request)
            parsed = await run_in_threadpool(parse_messages, body, self._tokenizer, self._served)
            routing = Routing.from_headers(request.headers)
            generation = Generation(
                self._backend, self._tokenizer, parsed, request_id, started, routing
            )
            reply = _Reply(parsed, "msg_" + request_id)
            deltas = generation.deltas()
            if not parsed.stream:
                return JSONResponse(await _whole(reply, generation, deltas), headers=parsed.headers)
            first = await anext(deltas)
        except Exception as exc:
            return _error(exc)
        events = _events(reply, generation, first, deltas)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", **parsed.headers},
        )


class _Reply:
    """One reply's blocks: text, and tool_use blocks when the request offered tools."""

    def __init__(self, parsed: ParsedRequest, message_id: str) -> None:
        self.parsed = parsed
        self.id = message_id
        self.stream = ToolCallStream(parsed.tools.parser_object()) if parsed.tools else None
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.called = False

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.parsed.model}

    def blocks(self, text: str) -> list[dict[str, Any]]:
        if self.parsed.tools is None:
            return [{"type": "text", "text": text}] if text else []
        out = parse_output(self.parsed.tools.parser_object(), text)
        self.called = bool(out.tool_calls)
        blocks = [{"type": "text", "text": out.content}] if out.content else []
        return blocks + [
            {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": _input(c.arguments)}
            for c in out.tool_calls
        ]

    def stop(self, delta: Delta) -> tuple[str, str | None]:
        if delta.stop_sequence is not None:
            return "stop_sequence", delta.stop_sequence
        if self.called and delta.finish_reason == "stop":
            return "tool_use", None
        return _STOP.get(delta.finish_reason or "", "end_turn"), None

    def events(self, text: str, final: bool) -> list[tuple[str, dict[str, Any]]]:
        """The block events `text` adds (final: the reply is over)."""
        parts = self.stream.push(text, final) if self.stream else [ContentDelta(text)] * bool(text)
        out: list[tuple[str, dict[str, Any]]] = []
        for part in parts:
            if isinstance(part, ContentDelta):
                out += self._switch("text", {"type": "text", "text": ""})
                out.append(_delta(self.index, {"type": "text_delta", "text": part.text}))
            elif isinstance(part, CallStart):
                self.called = True
                block = {
                    "type": "tool_use",
                    "id": _tool_id(part.id),
                    "name": part.name,
                    "input": {},
                }
                out += self._switch("tool_use", block, new=True)
            elif isinstance(part, ArgumentsDelta):
                json_delta = {"type": "input_json_delta", "partial_json": part.text}
                out.append(_delta(self.index, json_delta))
        if final and self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None
        return out

    def _switch(self, kind: str, block: dict[str, Any], new: bool = False):
        if self.open == kind and not new:
            return []
        out = []
        if self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, ("content_block_start", start)]


async def _whole(
    reply: _Reply, generation: Generation, deltas: AsyncGenerator[Delta, None]
) -> dict[str, Any]:
    texts, last = [], Delta("")
    try:
        async for delta in deltas:
            texts.append(delta.text)
            last = delta
    finally:
        await deltas.aclose()
    content = reply.blocks("".join(texts))
    stop_reason, stop_sequence = reply.stop(last)
    return {
        **reply.head(),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(generation),
    }


async def _events(
    reply: _Reply, generation: Generation, first: Delta, deltas: AsyncGenerator[Delta, None]
) -> AsyncIterator[str]:
    start = {
        **reply.head(),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**_usage(generation), "output_tokens": 0},
    }
    yield _sse("message_start", {"type": "message_start", "message": start})
    try:
        delta: Delta | None = first
        last = first
        while delta is not None:
            last = delta
            for name, data in reply.events(delta.text, final=delta.finish_reason is not None):
                yield _sse(name, data)
            delta = await anext(deltas, None)
        stop_reason, stop_sequence = reply.stop(last)
        yield _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": _usage(generation),
            },
        )
        yield _sse("message_stop", {"type": "message_stop"})
    except Exception as exc:  # in-band: the HTTP status is already sent
        log.info("request.failed_in_stream", error=str(exc))
        yield _sse("error", anthropic_error_body(exc))
    finally:
        with anyio.CancelScope(shield=True):
            await deltas.aclose()


def _usage(generation: Generation) -> dict[str, int]:
    usage = generation.usage
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's tool_use.input is: what was written of them
    where max_tokens cut the call (stop_reason max_tokens says so), never a silent {}."""
    value = partial_json(arguments)
    return value if isinstance(value, dict) else {}


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error(exc: Exception) -> JSONResponse:
    status = http_status(exc)
    if status >= 500:
        log.error("request.failed", exc_info=exc)
    else:
        log.info("request.rejected", status=status, error=str(exc))
    return JSONResponse(anthropic_error_body(exc), status_code=status, headers=http_headers(exc))
