"""The gateway's OpenAI-compatible REST front end: a Starlette app over a GenerateBackend.

Request flow: read + parse the body (openai_protocol) -> backend.generate -> detokenize and apply
stop strings here -> one JSON body, or SSE chunks ending in `data: [DONE]`. Whenever the output
ends before the backend finished (a stop string, a client disconnect, an error) the request is
aborted down the chain with backend.abort(request_id).
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from importlib.metadata import version
from typing import Any

import anyio
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.engine.core.outputs import TokenLogprob
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import KvmeshError, WorkerUnavailableError
from kvmesh.mesh import error_mapping, metrics
from kvmesh.mesh.error_mapping import (
    http_headers,
    http_status,
    openai_error_body,
)
from services.gateway import openai_protocol as proto
from services.gateway import openai_responses as resp
from services.gateway import served as serving
from services.gateway.anthropic_api import AnthropicApi
from services.gateway.auth import ApiKeyMiddleware, ApiKeys
from services.gateway.backend import GenerateBackend
from services.gateway.choices import Choice, choice_requests, delta_events, merged, total_usage
from services.gateway.generation import SERVICE, Delta, Generation, Routing
from services.gateway.json_body import read_json
from services.gateway.limits import DEFAULT_LIMITS, RequestLimits
from services.gateway.openai_responses import LogprobFormatter, ResponseMeta
from services.gateway.openapi import openapi_document
from services.gateway.readiness import AlwaysReady, Readiness
from services.gateway.responses_api import ResponsesApi
from services.gateway.tool_output import ToolReply
from services.gateway.tool_output import finish_reason as finish_reason_of

log = structlog.get_logger(__name__)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def create_app(
    backend: GenerateBackend,
    tokenizer: Tokenizer,
    limits: RequestLimits = DEFAULT_LIMITS,
    readiness: Readiness | None = None,
    tool_parser: str | None = None,
    api_keys: ApiKeys | None = None,
    names: serving.ModelNames = serving.DEFAULT_NAMES,
) -> Starlette:
    """POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages (+ /count_tokens: Anthropic's
    API); GET /v1/models, /health (readiness: 503
    until a request would succeed), /live (liveness), /metrics. `tool_parser`: the format of
    the model's tool calls (None: chosen from its chat template). With `api_keys` every /v1/
    request needs one (auth.py); GET /openapi.json describes it all."""
    served = serving.served_model(
        backend.model_name, backend.max_model_len, tokenizer, limits, tool_parser, names
    )
    api = _OpenAIApi(backend, tokenizer, served)
    read = lambda request: read_json(request, limits.max_body_bytes)  # noqa: E731
    anthropic = AnthropicApi(backend, tokenizer, api.served, read)
    responses = ResponsesApi(backend, tokenizer, api.served, read)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        WebSocketRoute("/v1/responses", responses.refuse_websocket),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", _health_endpoint(readiness or AlwaysReady()), methods=["GET"]),
        Route("/live", _live, methods=["GET"]),
        Route("/", _live, methods=["GET", "HEAD"]),  # Claude Code's HEAD / before its first call
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/openapi.json", _openapi(api.served), methods=["GET"]),
    ]
    middleware = [Middleware(RequestIdMiddleware)]
    if api_keys is not None:
        middleware.append(Middleware(ApiKeyMiddleware, keys=api_keys))
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_exception},
    )


class RequestIdMiddleware:
    """Gives each request an id (x-request-id if valid, else fresh): in request.state, bound for
    structlog for the whole request (streaming included) and echoed as a response header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await self.app(scope, receive, send_with_id)


class _OpenAIApi:
    def __init__(
        self, backend: GenerateBackend, tokenizer: Tokenizer, served: serving.ServedModel
    ) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._max_body_bytes = served.limits.max_body_bytes
        self.served = served
        self._created = int(time.time())

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def models(self, request: Request) -> Response:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "kvmesh",
                "max_model_len": self.served.max_model_len,
            }
            for name in self.served.names
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def _generate(self, request: Request, kind: serving.Kind) -> Response:
        request_id: str = request.state.request_id
        started = time.monotonic()
        try:
            body = await read_json(request, self._max_body_bytes)
            parsed = await run_in_threadpool(
                proto.parse_request, kind, body, self._tokenizer, self.served
            )
            log.info(
                "request.accepted",
                kind=kind,
                prompt_tokens=len(parsed.prompt_token_ids),
                max_tokens=parsed.params.max_tokens,
                stream=parsed.stream,
            )
            routing = Routing.from_headers(request.headers)
            choices = [
                Choice(
                    i,
                    Generation(self._backend, self._tokenizer, one, rid, started, routing),
                    LogprobFormatter(kind, self._tokenizer, parsed.logprobs is not None),
                    ToolReply(parsed.tools) if parsed.tools is not None else None,
                )
                for i, (rid, one) in enumerate(choice_requests(parsed, request_id))
            ]
            meta = ResponseMeta.for_request(parsed, request_id)
            if parsed.stream:
                return await _stream(meta, choices, parsed.headers)
            result = await _complete(meta, choices)
        except Exception as exc:
            return _error_response(exc)
        _count("ok")
        return JSONResponse(result, headers=parsed.headers)


async def _complete(meta: ResponseMeta, choices: list[Choice]) -> dict[str, Any]:
    texts: list[list[str]] = [[] for _ in choices]
    logprobs: list[list[TokenLogprob | None]] = [[] for _ in choices]
    finish: list[str | None] = [None for _ in choices]
    async with contextlib.aclosing(merged([c.generation.deltas() for c in choices])) as deltas:
        async for index, delta in deltas:
            texts[index].append(delta.text)
            logprobs[index].extend(delta.logprobs)
            finish[index] = delta.finish_reason
    bodies = []
    for choice in choices:
        text = "".join(texts[choice.index])
        message = choice.tools.message(text) if choice.tools is not None else None
        reason = finish[choice.index]
        if message is not None:
            reason = finish_reason_of(reason, "tool_calls" in message)
        lps = choice.formatter.format(logprobs[choice.index])
        bodies.append(resp.response_body(meta, text, reason, lps, total_usage(choices), message))
    body = bodies[0]
    body["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    return body


async def _stream(
    meta: ResponseMeta, choices: list[Choice], extra: dict[str, str]
) -> StreamingResponse:
    """Waits for the first delta, so an error before any output is a plain HTTP error."""
    deltas = merged([c.generation.deltas() for c in choices])
    try:
        first = await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise
    events = _sse_events(meta, choices, first, deltas)
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **extra}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _sse_events(
    meta: ResponseMeta,
    choices: list[Choice],
    first: tuple[int, Delta],
    deltas: AsyncGenerator[tuple[int, Delta], None],
) -> AsyncIterator[bytes]:
    outcome = "cancelled"  # unless the loop below ends
    try:
        texts = [resp.TextChunks(meta, choice.index) for choice in choices]
        if meta.kind == "chat":
            for choice in choices:
                yield resp.sse_event(resp.chunk_body(meta, "", role=True, index=choice.index))
        item: tuple[int, Delta] | None = first
        while item is not None:
            index, delta = item
            for event in delta_events(meta, delta, choices[index], texts[index]):
                yield event
            item = await anext(deltas, None)
        if meta.include_usage:
            yield resp.sse_event(resp.usage_chunk_body(meta, total_usage(choices)))
        outcome = "ok"
    except Exception as exc:  # in-band: the HTTP status is already sent
        outcome = _outcome(http_status(exc))
        _log_error(exc)
        yield resp.sse_event(openai_error_body(exc))
    finally:
        with anyio.CancelScope(shield=True):
            await deltas.aclose()
        _count(outcome)
    yield b"data: [DONE]\n\n"


def _error_response(exc: Exception) -> JSONResponse:
    status = http_status(exc)
    _count(_outcome(status))
    _log_error(exc)
    return JSONResponse(openai_error_body(exc), status_code=status, headers=http_headers(exc))


def _log_error(exc: Exception) -> None:
    status = http_status(exc)
    if status == 500:
        log.error("request.failed", exc_info=exc)
    else:
        code = exc.code if isinstance(exc, KvmeshError) else None
        log.info("request.rejected", status=status, code=code, error=str(exc))


def _outcome(status: int) -> str:
    return "client_error" if status < 500 else "server_error"


def _count(outcome: str) -> None:
    metrics.REQUESTS.labels(SERVICE, outcome).inc()


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    body = error_mapping.error_body(str(exc.detail), "invalid_request_error", None)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _health_endpoint(readiness: Readiness):
    async def health(request: Request) -> Response:
        state = readiness.check()
        if state.ready:
            return JSONResponse({"status": "ok"})
        not_ready = WorkerUnavailableError(state.reason)
        return JSONResponse(openai_error_body(not_ready), status_code=http_status(not_ready))

    return health


async def _live(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _openapi(served: serving.ServedModel):
    document = openapi_document(served.name, served.limits, version("kvmesh"))

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    return openapi


async def _metrics(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
