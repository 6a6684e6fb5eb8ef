"""The gRPC Gateway's chat input (ChatMessages: messages with tool calls and results, tools,
tool choice) as the OpenAI chat body the chat translator reads: one set of rules for both."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.agent.conversation import Conversation
from kvmesh.errors import InvalidRequestError
from kvmesh.proto.v1 import gateway_pb2
from services.gateway.openai_chat import parse_conversation


def conversation_of(chat: gateway_pb2.ChatMessages) -> Conversation:
    body: dict[str, Any] = {"messages": [_message(m) for m in chat.messages]}
    if chat.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(chat.tools)]
    if chat.HasField("tool_choice") and chat.tool_choice.mode:
        choice = chat.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if choice.mode == "named"
            else choice.mode
        )
    if chat.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = chat.parallel_tool_calls
    return parse_conversation(body)


def _message(message: gateway_pb2.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def _tool(i: int, tool: gateway_pb2.Tool) -> dict[str, Any]:
    try:
        parameters = (
            json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object"}
        )
    except ValueError as exc:
        raise InvalidRequestError(f"'tools[{i}].parameters_json' is not JSON: {exc}") from exc
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": parameters,
        "strict": tool.strict,
    }
    return {"type": "function", "function": function}
