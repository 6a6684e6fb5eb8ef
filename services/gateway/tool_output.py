"""A chat reply read for tool calls (OpenAI chat shapes): the whole message, or SSE deltas
where a call's first delta carries its index, id and name and later ones only new argument
text, so the streamed arguments add up to exactly the non-streamed ones."""

from __future__ import annotations

from typing import Any

from kvmesh.agent.tool_parsers import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    StreamEvent,
    ToolCallStream,
    parse_output,
)
from services.gateway.openai_protocol import ToolSetup


class ToolReply:
    def __init__(self, setup: ToolSetup) -> None:
        self._setup = setup
        self._stream = ToolCallStream(setup.parser_object())

    @property
    def called(self) -> bool:
        """Whether the stream so far started a call."""
        return bool(self._stream.call_ids)

    def delta_bodies(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The `delta` objects of the chunks this text adds (final: the reply is over)."""
        return [_delta(event) for event in self._stream.push(text, final)]

    def message(self, text: str) -> dict[str, Any]:
        """The whole assistant message of a reply whose generated text is `text`."""
        parsed = parse_output(self._setup.parser_object(), text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if parsed.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in parsed.tool_calls
            ]
        return message


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that stopped after calling; others unchanged."""
    return "tool_calls" if called and reason == "stop" else reason


def _delta(event: StreamEvent) -> dict[str, Any]:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, CallStart):
        function = {"name": event.name, "arguments": ""}
        call = {"index": event.index, "id": event.id, "type": "function", "function": function}
        return {"tool_calls": [call]}
    assert isinstance(event, ArgumentsDelta)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
