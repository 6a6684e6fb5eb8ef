"""The model a gateway serves and the limits of one request to it: the names clients may ask
for (--served-model-name, --any-model), the output budget a prompt leaves (max_tokens clamped
or refused: --max-tokens-policy) and the context check, shared by the REST and gRPC fronts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.agent.tool_parsers import parser_for
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError
from services.gateway.limits import DEFAULT_LIMITS, RequestLimits

Kind = Literal["chat", "completion"]
DEFAULT_MAX_TOKENS = 1024  # max_tokens missing: the remaining context, capped at this


@dataclass(frozen=True)
class ModelNames:
    """The names clients may ask for the one model by (`kvmesh serve gateway` flags)."""

    served: tuple[str, ...] = ()  # --served-model-name, repeatable (none: the model's own name)
    any_model: bool = False  # --any-model: answer every model id with this model

    def of(self, model_name: str) -> tuple[str, ...]:
        return self.served or (model_name,)


DEFAULT_NAMES = ModelNames()


@dataclass(frozen=True)
class ServedModel:
    """The one model this gateway serves, under the names clients may use (the first is the
    one /v1/models lists first and a request without a model gets)."""

    name: str
    max_model_len: int
    tool_parser: str = "hermes"  # the format of the model's tool calls (agent/tool_parsers)
    limits: RequestLimits = DEFAULT_LIMITS
    aliases: tuple[str, ...] = ()  # further names for it
    any_model: bool = False  # every other name too (a single-model mesh, as llama.cpp does)

    @classmethod
    def named(
        cls,
        model_name: str,
        names: ModelNames,
        max_model_len: int,
        tool_parser: str,
        limits: RequestLimits,
    ) -> ServedModel:
        first, *aliases = names.of(model_name)
        return cls(first, max_model_len, tool_parser, limits, tuple(aliases), names.any_model)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def served_model(
    model_name: str,
    max_model_len: int,
    tokenizer: Tokenizer,
    limits: RequestLimits = DEFAULT_LIMITS,
    tool_parser: str | None = None,
    names: ModelNames = DEFAULT_NAMES,
) -> ServedModel:
    """What the REST and gRPC fronts serve: `tool_parser` None: chosen from the chat template."""
    parser = tool_parser or parser_for(tokenizer.hf.chat_template)
    return ServedModel.named(model_name, names, max_model_len, parser, limits)


def check_model(body: dict[str, Any], served: ServedModel) -> str:
    """The name the reply carries: the one asked for if served (or --any-model), the first
    served name when none was asked for; any other name is unknown (404)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("'model' must be of type string")
    if model is None:
        return served.name
    if model not in served.names and not served.any_model:
        names = ", ".join(f"`{name}`" for name in served.names)
        raise ModelNotFoundError(
            f"The model `{model}` does not exist (this server serves {names})."
        )
    return model


def default_max_tokens(prompt_len: int, served: ServedModel) -> int:
    # At least 1, so a prompt that fills the context fails the context check below.
    cap = served.limits.max_output_tokens or DEFAULT_MAX_TOKENS  # --max-output-tokens
    return max(1, min(served.max_model_len - prompt_len, DEFAULT_MAX_TOKENS, cap))


@dataclass(frozen=True)
class OutputBudget:
    max_tokens: int
    clamped_from: int | None = None  # what the client asked for, where it was clamped


def output_budget(
    kind: Kind, prompt_len: int, requested: int | None, served: ServedModel, n: int = 1
) -> OutputBudget:
    """The completion's max_tokens: the default where none was asked; one beyond what the
    context leaves the prompt clamped to it (--max-tokens-policy clamp: the reply ends with
    finish reason `length` there) or refused (refuse). A prompt that fills the context alone
    is refused either way."""
    if requested is None:
        requested = default_max_tokens(prompt_len, served)
    left = served.max_model_len - prompt_len
    if requested > left >= 1 and served.limits.max_tokens_policy == "clamp":
        served.limits.check(prompt_len, requested, n)  # an operator's own bound still refuses
        return OutputBudget(left, requested)
    check_context(kind, prompt_len, requested, served, n)
    return OutputBudget(requested)


def check_context(
    kind: Kind, prompt_len: int, max_tokens: int, served: ServedModel, n: int = 1
) -> None:
    """The configured limits (RequestLimits), then the model's context length."""
    served.limits.check(prompt_len, max_tokens, n)
    limit = served.max_model_len
    total = prompt_len + max_tokens
    if total <= limit:
        return
    if kind == "chat":
        detail = (
            f"({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    else:
        detail = (
            f"({prompt_len} in your prompt; {max_tokens} for the completion). "
            "Please reduce your prompt; or completion length."
        )
    raise ContextLengthError(
        f"This model's maximum context length is {limit} tokens. "
        f"However, you requested {total} tokens {detail}"
    )
