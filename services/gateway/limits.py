"""The gateway's configured request limits (flags of `kvmesh serve gateway` / `kvmesh up`): a
request above one is refused (400, or 413 for the body) with a message naming the limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.errors import InvalidRequestError

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_N = 16
MaxTokensPolicy = Literal["clamp", "refuse"]
MAX_TOKENS_POLICIES: tuple[str, ...] = ("clamp", "refuse")


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-request-body-bytes (413 past it)
    max_prompt_tokens: int = 0  # --max-prompt-tokens (0: the model's context length)
    max_output_tokens: int = 0  # --max-output-tokens: max_tokens and the like (0: no own bound)
    max_n: int = DEFAULT_MAX_N  # --max-n: choices per request
    # --max-tokens-policy: a max_tokens beyond what the context leaves the prompt is clamped to
    # it (agents send 32k-64k whatever the model; llama.cpp clamps too) or refused (as vLLM)
    max_tokens_policy: MaxTokensPolicy = "clamp"

    def __post_init__(self) -> None:
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ValueError(f"max_tokens_policy must be one of {MAX_TOKENS_POLICIES}")

    def check(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        if self.max_prompt_tokens and prompt_tokens > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {prompt_tokens} tokens, above this server's limit of "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)"
            )
        if self.max_output_tokens and max_tokens > self.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens is {max_tokens}, above this server's limit of "
                f"{self.max_output_tokens} (--max-output-tokens)"
            )
        if not 1 <= n <= self.max_n:
            raise InvalidRequestError(f"'n' must be in [1, {self.max_n}] (--max-n), got {n}")


DEFAULT_LIMITS = RequestLimits()
