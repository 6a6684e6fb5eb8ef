"""OpenAI response and streaming-chunk bodies (chat.completion, text_completion, usage, logprobs)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

from kvmesh.engine.core.outputs import TokenLogprob
from kvmesh.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from services.gateway.openai_protocol import ParsedRequest

Kind = Literal["chat", "completion"]
_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class ResponseMeta:
    """What every response body and stream chunk of one request shares."""

    kind: Kind
    id: str
    model: str
    created: int
    include_usage: bool = False  # streaming: chunks carry "usage": null, a last one the counts

    @classmethod
    def for_request(cls, parsed: ParsedRequest, request_id: str) -> ResponseMeta:
        prefix = "chatcmpl-" if parsed.kind == "chat" else "cmpl-"
        created = int(time.time())
        return cls(parsed.kind, prefix + request_id, parsed.model, created, parsed.include_usage)

    def head(self, chunk: bool) -> dict[str, Any]:
        chat_object = "chat.completion.chunk" if chunk else "chat.completion"
        obj = chat_object if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def response_body(
    meta: ResponseMeta,
    text: str,
    finish_reason: str | None,
    logprobs: Any,
    usage: Usage,
    message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole chat.completion (`message`: one read for tool calls) or text_completion."""
    choice: dict[str, Any] = {"index": 0}
    if meta.kind == "chat":
        choice["message"] = message or {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
    return {**meta.head(chunk=False), "choices": [choice], "usage": usage.to_json()}


def chunk_body(
    meta: ResponseMeta,
    text: str | None,
    finish_reason: str | None = None,
    logprobs: Any = None,
    role: bool = False,
    delta: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One stream chunk of choice `index`; chat's first chunk has role=True, the finishing one
    text=None; `delta`: a chat delta given whole (tool calls)."""
    choice: dict[str, Any] = {"index": index}
    if meta.kind == "chat":
        head = {"role": "assistant"} if role else {}
        choice["delta"] = {**head, **(delta or ({} if text is None else {"content": text}))}
    else:
        choice["text"] = text or ""
    choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
    body = {**meta.head(chunk=True), "choices": [choice]}
    return body | {"usage": None} if meta.include_usage else body


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying `body`."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


class TextChunks:
    """The events of choice `index`'s plain text chunks (no logprobs, no finish), cut once from
    chunk_body's around a marker: a token's event is then one orjson call and a join."""

    _MARK = "\x00kvmesh-text\x00"

    def __init__(self, meta: ResponseMeta, index: int) -> None:
        event = sse_event(chunk_body(meta, self._MARK, index=index))
        self._head, _, self._tail = event.rpartition(orjson.dumps(self._MARK))

    def event(self, text: str) -> bytes:
        return b"".join((self._head, orjson.dumps(text), self._tail))


def usage_chunk_body(meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the counts."""
    return {**meta.head(chunk=True), "choices": [], "usage": usage.to_json()}


class LogprobFormatter:
    """OpenAI logprobs JSON: chat's {"content": [...]} or completions' parallel arrays."""

    def __init__(self, kind: Kind, tokenizer: Tokenizer, enabled: bool) -> None:
        self._kind = kind
        self._tok = tokenizer
        self._enabled = enabled
        self._offset = 0  # completions: text_offset of the next token, across stream chunks

    def format(self, entries: Sequence[TokenLogprob | None]) -> dict[str, Any] | None:
        if not self._enabled:
            return None
        present = [e for e in entries if e is not None]
        if self._kind == "chat":
            return {"content": [self._chat_entry(e) for e in present]}
        return self._completion(present)

    def _token(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def _chat_top(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        top = [self._chat_top(t, lp) for t, lp in entry.top]
        return {**self._chat_top(entry.token_id, entry.logprob), "top_logprobs": top}

    def _completion(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens = [self._token(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        tops = [
            {self._token(t): _finite(lp) for t, lp in e.top} or {token: _finite(e.logprob)}
            for e, token in zip(entries, tokens, strict=True)
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB
