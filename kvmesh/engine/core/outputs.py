"""What the engine hands back: reservations (decode) and per-step token outputs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvmesh.engine.core.sequence import FinishReason
from kvmesh.errors import KvmeshError


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability under the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id in the raw distribution
    top: tuple[tuple[int, float], ...]  # the params.logprobs most likely (token_id, logprob)


@dataclass(frozen=True)
class Reservation:
    """Pages reserved for a prompt; the first `cached_pages` already hold its KV (prefix hit)."""

    page_ids: list[int]
    cached_pages: int
    cached_tokens: int
    page_tags: list[int]  # integrity tag of each page, which the writer must put beside it


@dataclass(slots=True)  # built per sequence per step: not frozen (slower to build); never mutated
class TokenOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob | None]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: KvmeshError | None = None  # set when the request was aborted by the engine

    def followed_by(self, then: TokenOutput) -> TokenOutput:
        """This output's tokens then `then`'s, with `then`'s state: one message for two steps
        (a stream consumer that fell behind)."""
        return replace(
            then,
            new_token_ids=[*self.new_token_ids, *then.new_token_ids],
            new_logprobs=[*self.new_logprobs, *then.new_logprobs],
        )
