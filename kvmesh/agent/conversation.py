"""The one internal request model every API translator produces (pure Python, no torch).

OpenAI chat / completions / Responses and Anthropic Messages each become a `Conversation`:
messages with roles system / developer / user / assistant / tool, the assistant's tool calls
with the model's JSON arguments as text, tool results with their call id, and the tools the
model may call with how it must choose among them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.errors import InvalidRequestError

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
ChoiceMode = Literal["none", "auto", "required", "named"]


def new_call_id() -> str:
    """A unique tool-call id in OpenAI's shape (call_ + 24 random characters)."""
    return "call_" + secrets.token_urlsafe(18)


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant made: `arguments` is the JSON text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""  # text parts joined by newlines
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    tool_call_id: str | None = None  # tool only: the call this result answers
    name: str | None = None  # tool only: the tool's name, where the API says it
    source: str = field(default="", compare=False)  # the request field it came from, for errors

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequestError(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError("only assistant messages carry tool calls")


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    strict: bool = False

    def openai_shape(self) -> dict[str, Any]:
        """{"type": "function", "function": {...}}: what chat templates with tools read."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode = "auto"
    name: str | None = None  # mode "named": the one tool the model must call

    def __post_init__(self) -> None:
        if (self.mode == "named") != (self.name is not None):
            raise InvalidRequestError("a named tool choice names exactly one tool")


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidRequestError("'messages' must be a non-empty array")
        check_turns(self.messages)
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tool names must be unique")
        if self.tool_choice.mode in ("required", "named") and not self.tools:
            raise InvalidRequestError(
                f"tool_choice {self.tool_choice.mode!r} needs at least one tool in 'tools'"
            )
        if self.tool_choice.name is not None and self.tool_choice.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {self.tool_choice.name!r}, which is not in 'tools'"
            )

    @property
    def offers_tools(self) -> bool:
        """Whether the prompt shows tools and the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice.mode != "none"


def check_turns(messages: tuple[Message, ...]) -> None:
    """Tool results answer the calls of the assistant turn just before them, each call once,
    and every call is answered before the conversation goes on (as OpenAI's and Anthropic's
    APIs require): a history a harness garbled is a 400 naming the message, not a prompt the
    model is left to make sense of."""
    pending: dict[str, str] = {}  # unanswered call id -> where its assistant turn came from
    for i, message in enumerate(messages):
        where = message.source or f"messages[{i}]"
        if message.role == "tool":
            if message.tool_call_id not in pending:
                raise InvalidRequestError(
                    f"'{where}' is a tool result for call {message.tool_call_id!r}, which is not "
                    "an unanswered call of the assistant turn before it"
                )
            del pending[message.tool_call_id]
            continue
        if pending:
            raise InvalidRequestError(_unanswered(pending, f"before '{where}'"))
        if message.tool_calls:
            ids = [call.id for call in message.tool_calls]
            if len(set(ids)) != len(ids):
                raise InvalidRequestError(f"'{where}' has two tool calls with one id")
            pending = dict.fromkeys(ids, where)
    if pending:
        raise InvalidRequestError(_unanswered(pending, "at the end of the conversation"))


def _unanswered(pending: dict[str, str], at: str) -> str:
    where = next(iter(pending.values()))
    ids = ", ".join(repr(call_id) for call_id in pending)
    return f"'{where}' made tool calls with no result {at}: {ids}"
