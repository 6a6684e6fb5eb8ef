"""The serving benchmarks' client: one streamed OpenAI request to any compatible server (kvmesh,
vLLM, llama.cpp's llama-server, SGLang), timed, its output length checked.

Every request asks for an exact length: `max_tokens` with `ignore_eos: true` (vLLM, SGLang,
llama.cpp and kvmesh honour it) and `min_tokens` = max_tokens (vLLM, SGLang; others ignore it).
Output tokens come from the usage chunk (`stream_options.include_usage`); a server that sends
none is counted by its content deltas (one token each on every server above, but a server may
merge some), and the request says so (`counted_by`). `exact` tells whether the length came out
as asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from kvmesh.errors import ServeBenchError
from kvmesh_apps.benchmarks.sse_client import post_events

Messages = list[dict[str, str]]
Prompt = str | Messages  # a string is sent as one user message (chat) or as the prompt


@dataclass(frozen=True)
class Target:
    """Where and how requests go. `url` is the server's root (a trailing /v1 is dropped)."""

    url: str
    model: str
    api: str = "chat"  # chat: /v1/chat/completions; completions: /v1/completions
    api_key: str | None = None
    min_tokens: bool = True  # also send min_tokens = max_tokens

    def __post_init__(self) -> None:
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be chat or completions, got {self.api!r}")
        object.__setattr__(self, "url", root_url(self.url))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request; tpot_s is None when it produced a single token."""

    ttft_s: float
    tpot_s: float | None
    tokens: int
    prompt_tokens: int | None = None
    counted_by: str = "usage"  # "usage" chunk, or "deltas" (content chunks counted)
    exact: bool = True  # tokens == the max_tokens asked for


@dataclass(frozen=True)
class Streamed:
    """What one stream delivered; `arrivals` are the content deltas' times after the send."""

    arrivals: tuple[float, ...]
    usage_tokens: int | None
    prompt_tokens: int | None
    max_tokens: int
    finish_reason: str | None = None
    sent_at: float = field(default=0.0, compare=False)  # time.perf_counter() of the send

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.arrivals)

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies: the time between consecutive content deltas."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    def timing(self) -> RequestTiming:
        first, last = self.arrivals[0], self.arrivals[-1]
        tpot = (last - first) / (self.tokens - 1) if self.tokens > 1 else None
        counted_by = "usage" if self.usage_tokens is not None else "deltas"
        return RequestTiming(
            first, tpot, self.tokens, self.prompt_tokens, counted_by, self.tokens == self.max_tokens
        )


def root_url(url: str) -> str:
    """http://host:port from http://host:port/, .../v1 or .../v1/."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def request_body(target: Target, prompt: Prompt, max_tokens: int, stream: bool = True) -> dict:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if target.min_tokens:
        body["min_tokens"] = max_tokens
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if target.api == "chat":
        body["messages"] = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        )
    else:
        body["prompt"] = (
            prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        )
    return body


def endpoint(target: Target) -> str:
    return f"{target.url}/v1/{'chat/completions' if target.api == 'chat' else 'completions'}"


def session(connections: int = 100, timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """The client of a benchmark run's plain (not streamed) requests."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def stream_request(
    target: Target, prompt: Prompt, max_tokens: int, timeout_s: float = 600.0
) -> Streamed:
    """Send one streaming request and collect its content deltas' arrival times and usage (on a
    connection of its own, read by benchmarks/sse_client.py: its TTFT includes the connect)."""
    body = request_body(target, prompt, max_tokens)
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    finish: str | None = None

    def on_chunk(chunk: dict[str, Any]) -> None:
        nonlocal finish
        for choice in chunk.get("choices") or []:
            if _content(choice):
                arrivals.append(time.perf_counter() - start)
            finish = choice.get("finish_reason") or finish
        usage.update(chunk.get("usage") or {})

    start = time.perf_counter()
    await post_events(endpoint(target), body, target.headers, on_chunk, timeout_s)
    if not arrivals:
        raise ServeBenchError(f"the stream from {endpoint(target)} carried no content")
    return Streamed(
        tuple(arrivals),
        usage.get("completion_tokens"),
        usage.get("prompt_tokens"),
        max_tokens,
        finish,
        start,
    )


def _content(choice: dict[str, Any]) -> str:
    """A chat delta's content or a completion chunk's text ('' for role-only chunks)."""
    delta = choice.get("delta")
    return (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")


async def stream_one(url: str, model: str, messages: Messages, max_tokens: int) -> RequestTiming:
    """One chat request to `url`, timed (the agent bench's and the warm-ups' call)."""
    return (await stream_request(Target(url, model), messages, max_tokens)).timing()


async def prompt_tokens(
    client: aiohttp.ClientSession, target: Target, prompt: Prompt
) -> int | None:
    """How many tokens the server makes of `prompt` (a one-token request's usage)."""
    body = request_body(target, prompt, 1, stream=False)
    async with client.post(endpoint(target), json=body, headers=target.headers) as r:
        if r.status != 200:
            raise ServeBenchError(f"HTTP {r.status} from {endpoint(target)}: {await r.text()}")
        return ((await r.json()).get("usage") or {}).get("prompt_tokens")


def first_model(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model `GET /v1/models` lists (what a foreign server serves)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{root_url(url)}/v1/models", headers=headers, timeout=timeout_s)
        r.raise_for_status()
        models = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ServeBenchError(f"GET {root_url(url)}/v1/models failed: {exc}") from exc
    if not models:
        raise ServeBenchError(f"{root_url(url)}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
