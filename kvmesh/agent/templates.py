"""A `Conversation` rendered into the model's prompt.

A chat template that knows tools (it reads a `tools` variable) gets the tools and the messages
in the shape transformers' templates expect. Any other template (SmolLM2's) gets the built-in
tool template instead: the tools and the call format (hermes: one JSON object per
<tool_call>...</tool_call>) in the system message, past calls written that way in the assistant
turns, tool results as <tool_response> blocks in a user turn; the model's own template then
renders those plain messages.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.agent.conversation import Conversation, Message

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
ONE_CALL = "\nCall at most one function in a reply."
REQUIRED = "\nYou must call a function in this reply."


def knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def template_messages(conversation: Conversation, chat_template: str | None) -> dict[str, Any]:
    """Keyword arguments for `apply_chat_template`: messages, and tools where it reads them."""
    if knows_tools(chat_template):
        kwargs: dict[str, Any] = {"messages": [_native(m) for m in conversation.messages]}
        if conversation.offers_tools:
            kwargs["tools"] = [tool.openai_shape() for tool in conversation.tools]
        return kwargs
    return {"messages": builtin_messages(conversation)}


def _native(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments_value(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments_value(arguments: str) -> Any:
    """Templates write arguments with `tojson`: a dict where the text is JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def builtin_messages(conversation: Conversation) -> list[dict[str, str]]:
    """Plain role/content messages carrying tools, calls and results in the hermes format."""
    messages: list[dict[str, str]] = []
    system: list[str] = []
    tools = _tools_system(conversation)  # after the caller's own system text, once

    def flush() -> None:
        nonlocal system, tools
        if system or tools:
            messages.append({"role": "system", "content": "\n\n".join(system + tools)})
        system, tools = [], []

    for message in conversation.messages:
        if message.role in ("system", "developer"):
            system.append(message.content)
            continue
        flush()
        if message.role == "tool":
            block = f"<tool_response>\n{message.content}\n</tool_response>"
            if messages and messages[-1].get("tool_results"):
                messages[-1]["content"] += "\n" + block
            else:
                messages.append({"role": "user", "content": block, "tool_results": "1"})
            continue
        content = message.content
        for call in message.tool_calls:
            call_json = f'{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}'
            content += ("\n" if content else "") + f"<tool_call>\n{call_json}\n</tool_call>"
        messages.append({"role": message.role, "content": content})
    flush()
    for message in messages:
        message.pop("tool_results", None)
    return messages


def _tools_system(conversation: Conversation) -> list[str]:
    if not conversation.offers_tools:
        return []
    tools = "\n".join(json.dumps(tool.openai_shape()) for tool in conversation.tools)
    text = TOOLS_PREAMBLE + tools + TOOLS_FORMAT
    if not conversation.parallel_tool_calls:
        text += ONE_CALL
    if conversation.tool_choice.mode in ("required", "named"):
        text += REQUIRED
    return [text]
