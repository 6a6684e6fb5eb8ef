"""One request's run through the mesh backend for the REST front end: routing headers,
incremental detokenization with stop strings, token counts and latency metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import structlog

from kvmesh.agent.tool_parsers import ToolParser
from kvmesh.engine.core.outputs import TokenLogprob
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.detokenizer import DetokenizeResult, IncrementalDetokenizer
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidRequestError, KvmeshError
from kvmesh.mesh import metrics
from services.gateway import openai_responses as resp
from services.gateway.auth import request_salt
from services.gateway.backend import (
    GenerateBackend,
    GenerateChunk,
    GenerateInput,
    unique_request_id,
)
from services.gateway.openai_protocol import ParsedRequest

log = structlog.get_logger(__name__)
SERVICE = "gateway"
MAX_TIMEOUT_S = 86400


@dataclass(frozen=True)
class Delta:
    """New output text (stop strings applied) with the logprobs of the tokens behind it."""

    text: str
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the output, if one did


@dataclass(frozen=True)
class Routing:
    """What the headers say about where a request should run and whose cache it may use."""

    session_id: str | None = None  # x-session-affinity
    cache_salt: str = ""  # the API key's, partitioned by x-kvmesh-cache-salt (auth.request_salt)
    timeout_s: float | None = None  # x-request-timeout: seconds the request may take in all

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Routing:
        timeout = _timeout(headers.get("x-request-timeout"))
        session = headers.get("x-session-affinity") or None
        salt = request_salt(headers, headers.get("x-kvmesh-cache-salt", ""))
        if session is not None and len(session) > 256:
            raise InvalidRequestError("x-session-affinity must be at most 256 characters")
        return cls(session, salt, timeout)


def _timeout(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise InvalidRequestError(
            f"x-request-timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {value!r}"
        )
    return seconds


class ReplyDetokenizer:
    """Incremental text with stop strings. A reply read for tool calls keeps the special tokens
    its format delimits calls with, and no other (a chat template's <|im_start|> is not
    content), never the ones that end it (EOS, stop ids); its stop strings apply to its
    content only: a call's arguments are never cut."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        stop: tuple[str, ...],
        prompt: Sequence[int],
        tools: ToolParser | None,
    ) -> None:
        skip_special = params.skip_special_tokens and tools is None
        hidden = (
            frozenset() if skip_special else tokenizer.eos_token_ids | set(params.stop_token_ids)
        )
        if tools is not None and params.skip_special_tokens:
            hidden |= tokenizer.all_special_ids - _token_ids(tokenizer, tools.delimiters)
        self._hidden = hidden
        self._inner = IncrementalDetokenizer(
            tokenizer,
            stop,
            params.include_stop_str_in_output,
            skip_special,
            prompt,
            tools.call_start if tools is not None else None,
        )

    def push(self, token_ids: Sequence[int], final: bool) -> DetokenizeResult:
        if self._hidden:
            token_ids = [t for t in token_ids if t not in self._hidden]
        return self._inner.push(token_ids, final=final)


def _token_ids(tokenizer: Tokenizer, texts: Sequence[str]) -> frozenset[int]:
    """The ids of the texts that are one token each in this tokenizer."""
    ids = {text: tokenizer.hf.convert_tokens_to_ids(text) for text in texts}
    return frozenset(
        i
        for text, i in ids.items()
        if i is not None and tokenizer.hf.convert_ids_to_tokens(i) == text
    )


class Generation:
    """One request's run through the backend; counts tokens and records latency metrics."""

    def __init__(
        self,
        backend: GenerateBackend,
        tokenizer: Tokenizer,
        parsed: ParsedRequest,
        request_id: str,
        started: float,
        routing: Routing,
    ) -> None:
        self._backend = backend
        self._routing = routing
        self._parsed = parsed
        self._request_id = unique_request_id(request_id)  # what its abort names
        self._started = started
        params = parsed.params
        tools = parsed.tools.parser_object() if parsed.tools is not None else None
        self._detok = ReplyDetokenizer(
            tokenizer, params, parsed.stop, parsed.prompt_token_ids, tools
        )
        self._echo = parsed.echo
        self._first_token_at: float | None = None
        self._backend_finished = False
        self._closed = False
        self.prompt_tokens = len(parsed.prompt_token_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0

    @property
    def usage(self) -> resp.Usage:
        return resp.Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Text deltas; the last one has finish_reason. Aborts the backend if cut short."""
        timeout = self._routing.timeout_s
        request = GenerateInput(
            self._request_id,
            list(self._parsed.prompt_token_ids),
            self._parsed.params,
            self._routing.session_id,
            self._routing.cache_salt,
            None if timeout is None else self._started + timeout,
        )
        stream = self._backend.generate(request)
        try:
            async for chunk in stream:
                delta = self._consume(chunk)
                if delta.finish_reason is not None:
                    await self._close(stream)  # abort a stop-string hit before the client reads
                    yield delta
                    return
                yield delta
            raise KvmeshError("the backend stream ended without a finish reason")
        finally:
            await self._close(stream)

    def _consume(self, chunk: GenerateChunk) -> Delta:
        if chunk.token_ids and self._first_token_at is None:
            self._first_token_at = time.monotonic()
            metrics.REQUEST_TTFT.labels(SERVICE).observe(self._first_token_at - self._started)
        self.completion_tokens += len(chunk.token_ids)
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self._backend_finished = chunk.finish_reason is not None
        result = self._detok.push(chunk.token_ids, final=self._backend_finished)
        finish = "stop" if result.stopped_on is not None else chunk.finish_reason
        text, self._echo = self._echo + result.delta, ""  # echo: the prompt comes first
        return Delta(text, list(chunk.logprobs), finish, result.stopped_on)

    async def _close(self, stream: AsyncIterator[GenerateChunk]) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):  # runs even while the request is being cancelled
            if not self._backend_finished:
                await self._abort()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        self._record_tokens()

    async def _abort(self) -> None:
        log.info("request.abort", generated=self.completion_tokens)
        try:
            await self._backend.abort(self._request_id)
        except Exception as exc:  # the request is over for us either way
            log.warning("request.abort_failed", error=repr(exc))

    def _record_tokens(self) -> None:
        metrics.PROMPT_TOKENS.labels(SERVICE).inc(self.prompt_tokens)
        metrics.PROMPT_CACHED_TOKENS.labels(SERVICE).inc(self.cached_tokens)
        metrics.GENERATION_TOKENS.labels(SERVICE).inc(self.completion_tokens)
        if self._first_token_at is not None and self.completion_tokens > 1:
            decode_s = time.monotonic() - self._first_token_at
            metrics.REQUEST_TPOT.labels(SERVICE).observe(decode_s / (self.completion_tokens - 1))
