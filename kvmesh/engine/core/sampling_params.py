"""Sampling parameters of one request: plain, frozen, validated data (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from kvmesh.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_INT_RANGES = {  # the proto field types: uint32 max_tokens, int32 top_k, int64 seed
    "max_tokens": (1, 2**32 - 1),
    "top_k": (0, 2**31 - 1),
    "seed": (-(2**63), 2**63 - 1),
}


MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop, as in vLLM / OpenAI."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF semantics, over prompt and output
    presence_penalty: float = 0.0  # OpenAI semantics, over output
    frequency_penalty: float = 0.0  # OpenAI semantics, over output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; N: the sampled token plus N alternatives
    skip_special_tokens: bool = True
    grammar: str | None = None  # an llguidance grammar the output must follow (agent/grammars)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = tuple(sorted(dict((int(t), float(b)) for t, b in self.logit_bias).items()))
        object.__setattr__(self, "logit_bias", bias)  # by token id, one value each
        _check(
            all(-100.0 <= b <= 100.0 for _, b in self.logit_bias),
            "logit_bias values must be in [-100, 100]",
        )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(  # bounded: a logit divided by 1e308 is no longer a number in fp32
            0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        self._check_wire_ranges()
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(len(self.stop) <= 16, "at most 16 stop strings")

    def _check_wire_ranges(self) -> None:
        """Integers must fit the fields that carry them between services (common.proto)."""
        for name, (low, high) in _INT_RANGES.items():
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and low <= value <= high),
                f"{name} must be an integer in [{low}, {high}], got {value!r}",
            )
        _check(
            all(isinstance(t, int) and 0 <= t < 2**32 for t in self.stop_token_ids),
            "stop_token_ids must be integers in [0, 4294967295]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @cached_property
    def argmax_only(self) -> bool:
        """Greedy without penalties or logprobs: the row's argmax is all the sampler reads of
        it (asked of every row every step, hence computed once)."""
        return (
            self.greedy
            and not self.needs_penalties
            and self.logprobs is None
            and not self.has_processors
        )

    @cached_property
    def has_processors(self) -> bool:
        """A grammar or a logit bias changes the logits before sampling (asked of every row
        every step)."""
        return self.grammar is not None or bool(self.logit_bias)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
