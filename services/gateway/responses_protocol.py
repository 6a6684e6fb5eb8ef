"""OpenAI Responses (stateless) -> the internal `Conversation` and a `ParsedRequest`: `input` as
a string or items (messages with roles system / developer / user / assistant, function_call
and function_call_output items; reasoning items accepted, not rendered), `instructions`, flat
function `tools`, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `text.format`."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from kvmesh.agent.conversation import ROLES, Conversation
from kvmesh.agent.tool_grammar import reply_grammar
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidRequestError
from services.gateway import openai_protocol as common
from services.gateway import served as served_mod
from services.gateway.openai_chat import parse_conversation as parse_chat
from services.gateway.openai_protocol import ParsedRequest, ToolSetup
from services.gateway.output_format import output_grammar
from services.gateway.responses_tools import ResponsesTools, model_name
from services.gateway.served import ServedModel

_TEXT_PARTS = ("input_text", "output_text", "text")
# accepted, nothing to render: reasoning the model cannot read back, tools (collected by
# ResponsesTools), Codex's per-turn settings
_NOT_RENDERED = ("reasoning", "additional_tools", "configuration_update")


@dataclass(frozen=True)
class ResponsesRequest:
    parsed: ParsedRequest
    tools: ResponsesTools  # how the model's calls go back (namespaces, custom tools)


def parse_response_request(
    body: Any, tokenizer: Tokenizer, served: ServedModel
) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise InvalidRequestError(
            "'previous_response_id' is not supported: this server is stateless; send the "
            "whole conversation in 'input'"
        )
    tools = ResponsesTools.of(body)
    conversation = parse_conversation(body, tools)
    prompt = common.chat_prompt(conversation, tokenizer)
    requested = body.get("max_output_tokens")
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool)):
        raise InvalidRequestError("'max_output_tokens' must be an integer")
    budget = served_mod.output_budget("chat", len(prompt), requested, served)
    grammar = reply_grammar(
        conversation, served.tool_parser, tokenizer.hf, _text_format(body), "text.format"
    )
    fields = {n: float(body[n]) for n in ("temperature", "top_p") if _number(body, n)}
    params = SamplingParams(max_tokens=budget.max_tokens, grammar=grammar, **fields)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidRequestError("'stream' must be a boolean")
    model = served_mod.check_model(body, served)
    parsed = ParsedRequest(
        "chat",
        model,
        tuple(prompt),
        replace(params, stop=()),
        (),
        stream,
        tools=ToolSetup.of(conversation, served.tool_parser),
        clamped_from=budget.clamped_from,
    )
    return ResponsesRequest(parsed, tools)


def parse_conversation(body: dict[str, Any], tools: ResponsesTools | None = None) -> Conversation:
    """The Responses body as chat messages, then the chat translator's rules (one place)."""
    tools = ResponsesTools.of(body) if tools is None else tools
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("'input' must be a string or a non-empty array of items")
    messages: list[dict[str, Any]] = []
    sources: list[str] = []  # where each message came from, for errors
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
        sources.append("instructions")
    for i, item in enumerate(items):
        made = _item(i, item, messages)
        messages.extend(made)
        sources.extend([f"input[{i}]"] * len(made))
    chat = {
        "messages": messages,
        "tools": list(tools.functions),
        "tool_choice": _choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
    }
    return parse_chat({k: v for k, v in chat.items() if v not in (None, [])}, sources)


def _item(i: int, item: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    at = f"input[{i}]"
    if not isinstance(item, dict):
        raise InvalidRequestError(f"'{at}' must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ROLES or item.get("role") == "tool":
            raise InvalidRequestError(f"'{at}.role' must be system, developer, user or assistant")
        return [{"role": item["role"], "content": _content(at, item.get("content"))}]
    if kind in ("function_call", "custom_tool_call"):
        return _call(item, kind, messages)
    if kind in ("function_call_output", "custom_tool_call_output"):
        content = _output(at, item.get("output"))
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": content}]
    if kind in _NOT_RENDERED:
        return []
    raise InvalidRequestError(
        f"'{at}.type' {kind!r} is not supported (message, function_call, function_call_output, "
        "custom_tool_call, custom_tool_call_output, reasoning, additional_tools)"
    )


def _call(item: dict[str, Any], kind: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A past call, named as the model saw it; a custom tool's text as its `input` argument."""
    if kind == "custom_tool_call":
        arguments = json.dumps({"input": item.get("input", "")}, ensure_ascii=False)
    else:
        arguments = item.get("arguments", "{}")
    name = model_name(item.get("name"), item.get("namespace"))
    call = {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
        messages[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one turn
        return []
    return [{"role": "assistant", "content": None, "tool_calls": [call]}]


def _output(at: str, output: Any) -> str:
    """A tool's output: a string, or content parts (Codex sends input_text parts)."""
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise InvalidRequestError(f"'{at}.output' must be a string or an array of content parts")
    texts = []
    for part in output:
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if kind in _TEXT_PARTS else f"[{kind}: not shown to this model]"
        texts.append(text if isinstance(text, str) else "")
    return "\n".join(texts)


def _content(at: str, content: Any) -> Any:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return [
            {"type": "text", "text": p.get("text")}
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
            else p
            for p in content
        ]
    raise InvalidRequestError(f"'{at}.content' must be a string or an array of text parts")


def _choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = model_name(choice.get("name"), choice.get("namespace"))
        return {"type": "function", "function": {"name": name}}
    return choice


def _text_format(body: dict[str, Any]) -> str | None:
    text = body.get("text") or {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # flat in Responses
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    return output_grammar({"response_format": fmt})


def _number(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"'{name}' must be a number")
    return True
