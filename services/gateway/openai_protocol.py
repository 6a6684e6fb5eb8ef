"""OpenAI request parsing and response shapes for the gateway's REST front end (no HTTP here).

Parsing turns a chat or completions body into a tokenized, validated `ParsedRequest`; the
builders write OpenAI's exact JSON shapes. Only n=1 is supported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

import jinja2

from kvmesh.agent.conversation import Conversation, Tool
from kvmesh.agent.templates import template_messages
from kvmesh.agent.tool_grammar import reply_grammar
from kvmesh.agent.tool_parsers import ToolParser, get_parser
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidRequestError
from services.gateway.openai_chat import parse_conversation
from services.gateway.output_format import output_grammar
from services.gateway.served import Kind, ServedModel, check_model, output_budget

T = TypeVar("T")

_MIN_LOGPROB = -9999.0  # JSON has no -inf
_UNSUPPORTED = ("suffix",)  # unless null/false/empty
_SAMPLING_FIELDS: tuple[tuple[type, tuple[str, ...]], ...] = (  # passed on to SamplingParams
    (float, ("temperature", "top_p", "min_p", "repetition_penalty")),
    (float, ("presence_penalty", "frequency_penalty")),
    (int, ("top_k", "seed")),
    (bool, ("ignore_eos", "include_stop_str_in_output")),
)
_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string"}
_JSON_NAMES.update({list: "array", dict: "object"})


@dataclass(frozen=True)
class ToolSetup:
    """How a chat reply that may call tools is read: by this parser (agent/tool_parsers)."""

    parser: str
    tools: tuple[Tool, ...] = ()  # the tools offered (glm45 types argument values by them)

    @classmethod
    def of(cls, conversation: Conversation, parser: str) -> ToolSetup | None:
        """None when the request offers no tools (its reply is plain text)."""
        return cls(parser, conversation.tools) if conversation.offers_tools else None

    def parser_object(self) -> ToolParser:
        return get_parser(self.parser, self.tools)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated, tokenized /v1/chat/completions or /v1/completions request."""

    kind: Kind
    model: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # without stop strings: the gateway applies those itself
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    user: str | None = None
    tools: ToolSetup | None = None  # chat with tools offered: the reply is parsed for calls
    echo: str = ""  # completions with echo: the prompt's text, sent before the completion
    n: int = 1  # choices, generated at once (choices.py)
    clamped_from: int | None = None  # the max_tokens asked for, where the context clamped it

    @property
    def headers(self) -> dict[str, str]:
        """Response headers that say what the server changed: a clamped max_tokens."""
        if self.clamped_from is None:
            return {}
        return {"x-kvmesh-max-tokens-clamped": f"{self.clamped_from}->{self.params.max_tokens}"}

    @property
    def logprobs(self) -> int | None:
        """None: off; N: the sampled token plus N alternatives."""
        return self.params.logprobs


def parse_request(
    kind: Kind, body: Any, tokenizer: Tokenizer, served: ServedModel
) -> ParsedRequest:
    """Validate `body` (decoded JSON); raises InvalidRequestError / ModelNotFoundError."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = check_model(body, served)
    _check_unsupported(body)
    stream, include_usage = _stream_options(body)
    tools, conversation, echo = None, None, ""
    if kind == "chat":
        if body.get("echo"):
            raise InvalidRequestError("'echo' is only for /v1/completions")
        conversation = parse_conversation(body)
        tools = ToolSetup.of(conversation, served.tool_parser)
        prompt = chat_prompt(conversation, tokenizer)
        requested = _get(body, "max_completion_tokens", int)
        requested = _get(body, "max_tokens", int) if requested is None else requested
        logprobs = _chat_logprobs(body)
    else:
        prompt = _completion_prompt(body, tokenizer)
        requested = _get(body, "max_tokens", int)
        logprobs = _get(body, "logprobs", int)
        echo = _echo(body, prompt, tokenizer, logprobs)
    budget = output_budget(kind, len(prompt), requested, served, _n(body))
    grammar = output_grammar(body)
    if conversation is not None:
        grammar = reply_grammar(
            conversation, served.tool_parser, tokenizer.hf, grammar, "response_format"
        )
    bias = _logit_bias(body, tokenizer.vocab_size)
    params = _sampling(body, budget.max_tokens, logprobs, grammar, bias)
    return ParsedRequest(
        kind,
        model,
        tuple(prompt),
        replace(params, stop=()),
        params.stop,
        stream,
        include_usage,
        _get(body, "user", str),
        tools,
        echo,
        _n(body),
        budget.clamped_from,
    )


def _get(body: dict[str, Any], name: str, kind: type[T]) -> T | None:
    """body[name] checked against a JSON type (bools are not numbers); None when null/absent."""
    value = body.get(name)
    if value is None:
        return None
    is_bool = isinstance(value, bool)
    if kind is float and isinstance(value, int | float) and not is_bool:
        return float(value)  # type: ignore[return-value]
    if isinstance(value, kind) and (kind is bool or not is_bool):
        return value
    got = _JSON_NAMES.get(type(value), type(value).__name__)
    raise InvalidRequestError(f"'{name}' must be of type {_JSON_NAMES[kind]}, got {got}")


def _check_unsupported(body: dict[str, Any]) -> None:
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}, ""):
            raise InvalidRequestError(f"'{name}' is not supported")
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != (_get(body, "n", int) or 1):
        raise InvalidRequestError(f"only best_of=n is supported, got best_of={best_of}")


def _n(body: dict[str, Any]) -> int:
    n = _get(body, "n", int)
    return 1 if n is None else n  # checked against the limit by check_context


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_get(body, "stream", bool))
    options = _get(body, "stream_options", dict) or {}
    if options and not stream:
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true")
    return stream, bool(_get(options, "include_usage", bool))


def chat_prompt(conversation: Conversation, tokenizer: Tokenizer) -> list[int]:
    kwargs = template_messages(conversation, tokenizer.hf.chat_template)
    try:
        return tokenizer.encode_chat(kwargs.pop("messages"), **kwargs)
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"the chat template rejected 'messages': {exc}") from exc


def _completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    else:
        raise InvalidRequestError(
            "'prompt' must be a string, an array of one string, or an array of token ids "
            "(batches of several prompts are not supported)"
        )
    if not ids:
        raise InvalidRequestError("'prompt' must not be empty")
    if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
        raise InvalidRequestError(f"'prompt' has token ids outside [0, {tokenizer.vocab_size})")
    return ids


def _echo(
    body: dict[str, Any], prompt: list[int], tokenizer: Tokenizer, logprobs: int | None
) -> str:
    """The prompt as text (a string prompt exactly as sent) when 'echo' is true."""
    if not _get(body, "echo", bool):
        return ""
    if logprobs is not None:
        raise InvalidRequestError("'echo' with 'logprobs' is not supported (no prompt logprobs)")
    sent = body.get("prompt")
    sent = sent[0] if isinstance(sent, list) and len(sent) == 1 else sent
    return sent if isinstance(sent, str) else tokenizer.decode(prompt)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    enabled = _get(body, "logprobs", bool)
    top = _get(body, "top_logprobs", int)
    if top is not None and not enabled:
        raise InvalidRequestError("'top_logprobs' requires 'logprobs' to be true")
    return (top or 0) if enabled else None


def _sampling(
    body: dict[str, Any],
    max_tokens: int,
    logprobs: int | None,
    grammar: str | None,
    logit_bias: tuple[tuple[int, float], ...],
) -> SamplingParams:
    values = {n: _get(body, n, kind) for kind, names in _SAMPLING_FIELDS for n in names}
    given = {name: value for name, value in values.items() if value is not None}
    return SamplingParams(
        max_tokens=max_tokens,
        logprobs=logprobs,
        stop=_stop(body),
        grammar=grammar,
        logit_bias=logit_bias,
        **given,
    )


def _logit_bias(body: dict[str, Any], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]}."""
    bias = _get(body, "logit_bias", dict) or {}
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab):
            raise InvalidRequestError(f"'logit_bias' keys must be token ids in [0, {vocab})")
        if isinstance(value, bool) or not isinstance(value, int | float) or abs(value) > 100:
            raise InvalidRequestError(f"'logit_bias[{key}]' must be a number in [-100, 100]")
        out.append((int(key), float(value)))
    return tuple(out)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidRequestError("'stop' must be a string or an array of strings")
