"""POST /v1/responses: OpenAI's Responses API, stateless, over the same backend and generation.
Output items are a message (output_text) and function_call items; streaming sends every event
with a sequence number: response.created / in_progress, per item output_item.added,
content_part.added, output_text.delta / function_call_arguments.delta, their *.done events,
output_item.done, then response.completed (or response.incomplete when cut by the limit)."""

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
from starlette.websockets import WebSocket

from kvmesh.agent.tool_parsers import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
    get_parser,
)
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.mesh.error_mapping import http_headers, http_status, openai_error_body
from services.gateway.backend import GenerateBackend
from services.gateway.generation import Delta, Generation, Routing
from services.gateway.openai_protocol import ParsedRequest
from services.gateway.responses_protocol import ResponsesRequest, parse_response_request
from services.gateway.responses_tools import ResponsesTools, custom_input
from services.gateway.served import ServedModel

log = structlog.get_logger(__name__)


class ResponsesApi:
    def __init__(
        self, backend: GenerateBackend, tokenizer: Tokenizer, served: ServedModel, read_json
    ) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._served = served
        self._read_json = read_json

    async def create(self, request: Request) -> Response:
        request_id: str = request.state.request_id
        started = time.monotonic()
        try:
            body = await self._read_json(request)
            asked = await run_in_threadpool(
                parse_response_request, body, self._tokenizer, self._served
            )
            parsed, headers = asked.parsed, _headers(asked)
            generation = Generation(
                self._backend,
                self._tokenizer,
                parsed,
                request_id,
                started,
                Routing.from_headers(request.headers),
            )
            reply = _Reply(parsed, request_id, body, asked.tools)
            deltas = generation.deltas()
            if not parsed.stream:
                return JSONResponse(await _whole(reply, generation, deltas), headers=headers)
            first = await anext(deltas)
        except Exception as exc:
            status = http_status(exc)
            log.info("request.rejected", status=status, error=str(exc))
            return JSONResponse(
                openai_error_body(exc), status_code=status, headers=http_headers(exc)
            )
        return StreamingResponse(
            _events(reply, generation, first, deltas),
            media_type="text/event-stream",
            headers=headers,
        )

    async def refuse_websocket(self, websocket: WebSocket) -> None:
        """Codex tries a WebSocket to /v1/responses first: 426 sends it to HTTP at once (any
        other answer costs it seconds of retries, a 400 ends its run)."""
        body = {
            "error": {
                "message": "WebSocket is not supported: POST /v1/responses",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        await websocket.send_denial_response(JSONResponse(body, status_code=426))


def _headers(asked: ResponsesRequest) -> dict[str, str]:
    """What the server changed: a clamped max_tokens, hosted tools it cannot run."""
    headers = dict(asked.parsed.headers)
    if asked.tools.not_offered:
        log.info("request.tools_not_offered", tools=list(asked.tools.not_offered))
        headers["x-kvmesh-tools-not-offered"] = ",".join(asked.tools.not_offered)
    return headers


class _Reply:
    """The response object and its output items, built as the text arrives."""

    def __init__(
        self, parsed: ParsedRequest, request_id: str, body: dict[str, Any], tools: ResponsesTools
    ) -> None:
        parser = parsed.tools.parser_object() if parsed.tools else get_parser("hermes")
        self.stream = ToolCallStream(parser) if parsed.tools else None
        self.tools = tools
        self.arguments = ""  # of the open call, as the model writes them
        self.request_id = request_id
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self.base = {
            "id": "resp_" + request_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": parsed.model,
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "instructions": body.get("instructions"),
            "max_output_tokens": parsed.params.max_tokens,
            "temperature": parsed.params.temperature,
            "top_p": parsed.params.top_p,
            "error": None,
            "incomplete_details": None,
            "metadata": {},
        }

    def response(self, status: str, generation: Generation | None = None) -> dict[str, Any]:
        out = {**self.base, "status": status, "output": [i for i in self.items]}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if generation is not None:
            usage = generation.usage
            out["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            }
        return out

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def push(self, text: str, final: bool) -> list[str]:
        parts = self.stream.push(text, final) if self.stream else [ContentDelta(text)] * bool(text)
        out: list[str] = []
        for part in parts:
            if isinstance(part, ContentDelta):
                out += self._message_open()
                item = self.items[-1]
                item["content"][0]["text"] += part.text
                out.append(
                    self.event(
                        "response.output_text.delta",
                        **self._at(),
                        content_index=0,
                        delta=part.text,
                        logprobs=[],
                    )
                )
            elif isinstance(part, CallStart):
                out += self._close()
                item = self.tools.call_item(part.name, part.id, "")
                prefix = "ctc" if item["type"] == "custom_tool_call" else "fc"
                self.items.append(
                    {**item, "id": f"{prefix}_{part.id[5:]}", "status": "in_progress"}
                )
                self.arguments = ""
                out.append(
                    self.event(
                        "response.output_item.added",
                        output_index=len(self.items) - 1,
                        item=dict(self.items[-1]),
                    )
                )
            elif isinstance(part, ArgumentsDelta):
                self.arguments += part.text
                if self.items[-1]["type"] == "function_call":  # a custom call's text: at its end
                    self.items[-1]["arguments"] = self.arguments
                    out.append(
                        self.event(
                            "response.function_call_arguments.delta", **self._at(), delta=part.text
                        )
                    )
        return out + (self._close() if final else [])

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _message_open(self) -> list[str]:
        if (
            self.items
            and self.items[-1]["type"] == "message"
            and self.items[-1]["status"] != "completed"
        ):
            return []
        out = self._close()
        part = {"type": "output_text", "text": "", "annotations": []}
        self.items.append(
            {
                "type": "message",
                "id": f"msg_{self.request_id}_{len(self.items)}",
                "status": "in_progress",
                "role": "assistant",
                "content": [part],
            }
        )
        added = {**self.items[-1], "content": []}
        out.append(
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)
        )
        out.append(
            self.event(
                "response.content_part.added", **self._at(), content_index=0, part=dict(part)
            )
        )
        return out

    def _close(self) -> list[str]:
        """The *.done events of the open item, if one is open."""
        if not self.items or self.items[-1]["status"] == "completed":
            return []
        item = self.items[-1]
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done",
                    **self._at(),
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self.event("response.content_part.done", **self._at(), content_index=0, part=part)
            )
        elif item["type"] == "custom_tool_call":
            item["input"] = custom_input(self.arguments)
            out.append(
                self.event(
                    "response.custom_tool_call_input.done", **self._at(), input=item["input"]
                )
            )
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **self._at(),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(
            self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)
        )
        return out


async def _whole(
    reply: _Reply, generation: Generation, deltas: AsyncGenerator[Delta, None]
) -> dict[str, Any]:
    last = Delta("")
    try:
        async for delta in deltas:
            reply.push(delta.text, final=delta.finish_reason is not None)
            last = delta
    finally:
        await deltas.aclose()
    return reply.response(_status(last), generation)


async def _events(
    reply: _Reply, generation: Generation, first: Delta, deltas: AsyncGenerator[Delta, None]
) -> AsyncIterator[str]:
    yield reply.event("response.created", response=reply.response("in_progress"))
    yield reply.event("response.in_progress", response=reply.response("in_progress"))
    try:
        delta: Delta | None = first
        last = first
        while delta is not None:
            last = delta
            for event in reply.push(delta.text, final=delta.finish_reason is not None):
                yield event
            delta = await anext(deltas, None)
        status = _status(last)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield reply.event(kind, response=reply.response(status, generation))
    except Exception as exc:  # in-band: the HTTP status is already sent
        log.info("request.failed_in_stream", error=str(exc))
        error = openai_error_body(exc)["error"]
        yield reply.event("error", code=error["code"], message=error["message"], param=None)
        failed = {
            **reply.response("failed"),
            "error": {"code": error["code"] or error["type"], "message": error["message"]},
        }
        yield reply.event("response.failed", response=failed)
    finally:
        with anyio.CancelScope(shield=True):
            await deltas.aclose()


def _status(last: Delta) -> str:
    return "incomplete" if last.finish_reason == "length" else "completed"
