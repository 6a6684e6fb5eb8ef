"""OpenAI chat completions -> the internal `Conversation`: messages (system, developer, user,
assistant with tool_calls, tool results), `tools`, `tool_choice`, `parallel_tool_calls`, and the
legacy `functions` / `function_call` mapped onto tools. Errors name the field at fault."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.agent.conversation import ROLES, Conversation, Message, Tool, ToolCall, ToolChoice
from kvmesh.errors import InvalidRequestError

_LEGACY_CALL = "call_legacy"  # the id of a legacy function_call and of its result


def parse_conversation(body: dict[str, Any], sources: list[str] | None = None) -> Conversation:
    """sources: where each message came from in the request, where it was not 'messages'."""
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise InvalidRequestError(f"'messages' must be of type array, got {_json_type(messages)}")
    if not messages:
        raise InvalidRequestError("'messages' is required and must be a non-empty array")
    legacy = body.get("functions") not in (None, [])
    if legacy and body.get("tools") not in (None, []):
        raise InvalidRequestError(
            "'functions' is deprecated: send 'tools' or 'functions', not both"
        )
    tools = _tools(body, "functions" if legacy else "tools", legacy)
    choice_field = "function_call" if legacy else "tool_choice"
    choice = _tool_choice(body.get(choice_field), choice_field, legacy)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean")
    return Conversation(
        tuple(
            _message(sources[i] if sources else f"messages[{i}]", m) for i, m in enumerate(messages)
        ),
        tools,
        ToolChoice("none") if choice is None and not tools else choice or ToolChoice("auto"),
        not legacy and parallel is not False,
    )


def _message(where: str, message: Any) -> Message:
    if not isinstance(message, dict):
        raise InvalidRequestError(f"'{where}' must be an object")
    role = message.get("role")
    if role == "function":  # legacy function result: answers the turn's one function_call
        role, message = "tool", {**message, "tool_call_id": _LEGACY_CALL}
    if role not in ROLES:
        raise InvalidRequestError(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}")
    content = _content(where, message.get("content"))
    if role == "assistant":
        calls = message.get("tool_calls") or []
        if message.get("function_call"):
            calls = [*calls, {"id": _LEGACY_CALL, "function": message["function_call"]}]
        return Message("assistant", content, _calls(where, calls), source=where)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"'{where}.tool_call_id' is required for a tool message")
        name = _opt_str(message, "name", where)
        return Message("tool", content, tool_call_id=call_id, name=name, source=where)
    return Message(role, content, source=where)


def _content(where: str, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"'{where}.content' must be a string or an array of parts")
    texts = []
    for j, part in enumerate(content):
        if not (
            isinstance(part, dict)
            and part.get("type") in ("text", "input_text", "output_text")
            and isinstance(part.get("text"), str)
        ):
            raise InvalidRequestError(
                f'\'{where}.content[{j}]\' must be {{"type": "text", "text": <string>}} '
                "(only text parts are supported)"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _calls(where: str, calls: Any) -> tuple[ToolCall, ...]:
    if not isinstance(calls, list):
        raise InvalidRequestError(f"'{where}.tool_calls' must be an array")
    out = []
    for k, call in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"'{at}.function.name' is required")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments)
        if not isinstance(arguments, str):
            raise InvalidRequestError(f"'{at}.function.arguments' must be a JSON string")
        call_id = call.get("id") or f"call_{k}"
        out.append(ToolCall(str(call_id), function["name"], arguments))
    return tuple(out)


def _tools(body: dict[str, Any], field: str, legacy: bool) -> tuple[Tool, ...]:
    given = body.get(field)
    if given is None:
        return ()
    if not isinstance(given, list):
        raise InvalidRequestError(f"'{field}' must be an array")
    return tuple(
        _tool(f"{field}[{i}]", t if legacy else _function(f"{field}[{i}]", t))
        for i, t in enumerate(given)
    )


def _function(where: str, tool: Any) -> Any:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f'\'{where}\' must be {{"type": "function", "function": ...}}')
    return tool.get("function")


def _tool(where: str, function: Any) -> Tool:
    if not isinstance(function, dict):
        raise InvalidRequestError(f"'{where}.function' must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise InvalidRequestError(f"'{where}.name' must be a string of 1 to 64 characters")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"'{where}.parameters' must be a JSON schema object")
    strict = function.get("strict") or False
    if not isinstance(strict, bool):
        raise InvalidRequestError(f"'{where}.strict' must be a boolean")
    description = _opt_str(function, "description", where) or ""
    return Tool(name, description, parameters, strict)


def _tool_choice(value: Any, field: str, legacy: bool) -> ToolChoice | None:
    if value is None:
        return None
    if value in ("none", "auto") or (value == "required" and not legacy):
        return ToolChoice(value)
    if isinstance(value, dict):
        function = value if legacy else value.get("function")
        if (legacy or value.get("type") == "function") and isinstance(function, dict):
            name = function.get("name")
            if isinstance(name, str):
                return ToolChoice("named", name)
    shapes = (
        '"none", "auto" or {"name": ...}'
        if legacy
        else ('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    )
    raise InvalidRequestError(f"'{field}' must be {shapes}")


def _opt_str(obj: dict[str, Any], name: str, where: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"'{where}.{name}' must be a string")
    return value


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object"}
    return names.get(type(value), type(value).__name__)
