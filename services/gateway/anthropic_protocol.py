"""Anthropic Messages -> the internal `Conversation` and a `ParsedRequest`: `system`, user and
assistant turns of text, `tool_use`, `tool_result` and (accepted, not rendered) `thinking`
blocks, `tools` with `input_schema`, `tool_choice` auto / any / tool / none (with
`disable_parallel_tool_use`), `stop_sequences`; errors name the field at fault."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from kvmesh.agent import grammars
from kvmesh.agent.conversation import Conversation, Message, Tool, ToolCall, ToolChoice
from kvmesh.agent.tool_grammar import reply_grammar
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidRequestError
from services.gateway import openai_protocol as common
from services.gateway import served as served_mod
from services.gateway.openai_protocol import ParsedRequest, ToolSetup
from services.gateway.served import ServedModel

_IGNORED_BLOCKS = ("thinking", "redacted_thinking")  # history an agent sends back: not rendered
_ROLES = ("user", "assistant", "system")
_NUMBERS = (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0))


def parse_messages(body: Any, tokenizer: Tokenizer, served: ServedModel) -> ParsedRequest:
    """A validated, tokenized POST /v1/messages body."""
    conversation = parse_conversation(body)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequestError("'max_tokens' is required and must be an integer >= 1")
    prompt = common.chat_prompt(conversation, tokenizer)
    budget = served_mod.output_budget("chat", len(prompt), max_tokens, served)
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError("'stop_sequences' must be an array of non-empty strings")
    fmt, where = _output_format(body)
    grammar = reply_grammar(conversation, served.tool_parser, tokenizer.hf, fmt, where)
    params = SamplingParams(
        max_tokens=budget.max_tokens, stop=tuple(stop), grammar=grammar, **_sampling_fields(body)
    )
    tools = ToolSetup.of(conversation, served.tool_parser)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidRequestError("'stream' must be a boolean")
    model = served_mod.check_model(body, served)
    return ParsedRequest(
        "chat",
        model,
        tuple(prompt),
        replace(params, stop=()),
        params.stop,
        stream,
        tools=tools,
        clamped_from=budget.clamped_from,
    )


def count_tokens(body: Any, tokenizer: Tokenizer, served: ServedModel) -> int:
    """POST /v1/messages/count_tokens: the prompt's length as this model renders it."""
    served_mod.check_model(body, served)
    return len(common.chat_prompt(parse_conversation(body), tokenizer))


def parse_conversation(body: Any) -> Conversation:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' is required and must be a non-empty array")
    turns = [*_system(body.get("system"))]
    for i, message in enumerate(messages):
        turns.extend(_turn(i, message))
    tools = tuple(_tool(i, t) for i, t in enumerate(_list(body, "tools")))
    choice, parallel = _tool_choice(body.get("tool_choice"), bool(tools))
    return Conversation(tuple(turns), tools, choice, parallel)


def _system(system: Any) -> list[Message]:
    if system is None or system == "":
        return []
    return [Message("system", _system_text("system", system))]


def _system_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(f"{where}[{j}]", b) for j, b in enumerate(content))
    raise InvalidRequestError(f"'{where}' must be a string or an array of text blocks")


def _turn(i: int, message: Any) -> list[Message]:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise InvalidRequestError(f'\'{where}.role\' must be "user", "assistant" or "system"')
    content = message.get("content")
    if message["role"] == "system":  # mid-conversation instructions: rendered where they stand
        return [Message("system", _system_text(f"{where}.content", content), source=where)]
    if isinstance(content, str):
        return [Message(message["role"], content)]
    if not isinstance(content, list):
        raise InvalidRequestError(f"'{where}.content' must be a string or an array of blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(at, block))
        elif kind == "tool_use" and message["role"] == "assistant":
            calls.append(_tool_use(at, block))
        elif kind == "tool_result" and message["role"] == "user":
            results.append(_tool_result(at, block))
        elif kind not in _IGNORED_BLOCKS:
            raise InvalidRequestError(
                f"'{at}.type' {kind!r} is not supported here (text, tool_use in assistant turns, "
                "tool_result in user turns, thinking)"
            )
    turn = (
        [Message(message["role"], "\n".join(texts), tuple(calls), source=where)]
        if texts or calls
        else []
    )
    return results + turn  # a user turn's tool results answer the calls before its text


def _text(at: str, block: Any) -> str:
    if (
        isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
    ):
        return block["text"]
    raise InvalidRequestError(f'\'{at}\' must be {{"type": "text", "text": <string>}}')


def _tool_use(at: str, block: dict) -> ToolCall:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidRequestError(f"'{at}' needs a string 'id' and 'name'")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"'{at}.input' must be an object")
    return ToolCall(block["id"], block["name"], json.dumps(arguments))


def _tool_result(at: str, block: dict) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"'{at}.tool_use_id' is required")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text(f"{at}.content[{k}]", b) for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequestError(f"'{at}.content' must be a string or an array of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return Message("tool", content, tool_call_id=call_id, source=at)


def _tool(i: int, tool: Any) -> Tool:
    at = f"tools[{i}]"
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequestError(f"'{at}.name' is required")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"'{at}.input_schema' must be a JSON schema object")
    description = tool.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"'{at}.description' must be a string")
    return Tool(tool["name"], description, schema, bool(tool.get("strict")))


def _tool_choice(value: Any, has_tools: bool) -> tuple[ToolChoice, bool]:
    if value is None:
        return ToolChoice("auto" if has_tools else "none"), True
    kind = value.get("type") if isinstance(value, dict) else None
    parallel = not (isinstance(value, dict) and value.get("disable_parallel_tool_use"))
    if kind in ("auto", "none"):
        return ToolChoice(kind), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "tool" and isinstance(value.get("name"), str):
        return ToolChoice("named", value["name"]), parallel
    raise InvalidRequestError(
        '\'tool_choice\' must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}'
    )


def _output_format(body: dict) -> tuple[str | None, str]:
    """Structured outputs: `output_config.format` (or the older `output_format`) as a grammar.
    `output_config.effort`, `thinking`, `context_management` and `metadata` are accepted and
    have no effect here (no reasoning budget; thinking is never rendered back)."""
    config = body.get("output_config") or {}
    if not isinstance(config, dict):
        raise InvalidRequestError("'output_config' must be an object")
    where = "output_config.format" if config.get("format") is not None else "output_format"
    fmt = config.get("format") if where == "output_config.format" else body.get("output_format")
    if fmt is None:
        return None, where
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    if fmt.get("type") != "json_schema" or not isinstance(schema, dict):  # type: ignore[union-attr]
        raise InvalidRequestError(
            f'\'{where}\' must be {{"type": "json_schema", "schema": {{...}}}}'
        )
    return grammars.json_schema(schema, f"{where}.schema"), where


def _list(body: dict, name: str) -> list:
    value = body.get(name) or []
    if not isinstance(value, list):
        raise InvalidRequestError(f"'{name}' must be an array")
    return value


def _sampling_fields(body: dict) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, low, high in _NUMBERS:
        value = body.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise InvalidRequestError(f"'{name}' must be a number in [{low}, {high}]")
        fields[name] = float(value)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InvalidRequestError("'top_k' must be an integer >= 0")
        fields["top_k"] = top_k
    return fields
