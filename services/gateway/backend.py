"""What the gateway's front ends (REST, gRPC) need from the mesh behind them.

The router + gRPC decode clients implement it for real; tests may use an in-process engine.
Token ids in, token ids out: tokenization, chat templates and detokenization stay in the gateway.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.engine.core.outputs import TokenLogprob
from kvmesh.engine.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateInput:
    """One request as the mesh sees it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop strings are handled by the gateway, not the mesh
    session_id: str | None = None  # x-session-affinity (used by the router later)
    cache_salt: str = ""
    deadline: float | None = None  # time.monotonic() by which it must end (x-request-timeout)


def unique_request_id(request_id: str) -> str:
    """The id a request goes by inside the mesh: the client's id, which two clients may share,
    plus a random part, so that ending one request never ends another."""
    return f"{request_id}.{secrets.token_hex(4)}"


@dataclass(frozen=True)
class GenerateChunk:
    """New tokens of one request; the last chunk has finish_reason (and the usage counts)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    cached_tokens: int = 0


class GenerateBackend(Protocol):
    """Streams token chunks for a request; raises a `kvmesh.errors.KvmeshError` on failure."""

    model_name: str
    max_model_len: int

    def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]: ...

    async def abort(self, request_id: str) -> None: ...
