"""What a tool-call parser is, and streaming built on top of it.

A parser only answers one question, `scan(text, final)`: in the output so far, which content
is certain and which calls (name, arguments text so far) does it hold. Streaming pushes text,
scans again and sends what grew; the final scan is the non-streamed answer, so the streamed
deltas always add up to it (a parser must keep every partial answer a prefix of the later ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.agent.conversation import Tool, ToolCall, new_call_id


@dataclass(frozen=True)
class CallState:
    name: str | None  # None until the text holds the whole name
    arguments: str  # the arguments' JSON text so far: all of it once `complete`
    complete: bool


@dataclass(frozen=True)
class ScanState:
    content: str  # text for the user (not a call), as far as it is certain
    calls: tuple[CallState, ...] = ()


class ToolParser(Protocol):
    name: str
    trigger: str  # the delimiter that begins a reply's calls
    delimiters: tuple[str, ...]  # every tag of the format (special tokens kept in the reply)
    bare_calls: bool  # whether a reply may also start with its calls, without the trigger

    def scan(self, text: str, final: bool) -> ScanState: ...

    def call_start(self, text: str) -> int:
        """Where the calls begin in `text` (-1: not yet); stop strings end content only."""
        ...

    def call_grammar(self, call_schema: dict, many: bool, literal: Any) -> str:
        """Lark rules (llguidance) whose rule `calls` is what follows the trigger (or starts
        the reply, for bare calls) in a reply of calls in this format: one call, or several
        when `many`; `literal` writes a delimiter (a special token of the model's tokenizer: by
        id). agent/tool_grammar.py builds whole grammars from them."""
        ...


class TaggedFormat:
    """What most formats share: calls begin at the trigger, and the request's tools are kept
    for formats whose argument values are typed by their schema (glm45)."""

    trigger: str
    bare_calls = False

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self.tools = tuple(tools)

    def call_start(self, text: str) -> int:
        return text.find(self.trigger)


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: its content and its calls (with fresh ids)."""

    content: str
    tool_calls: tuple[ToolCall, ...]


def parse_output(parser: ToolParser, text: str) -> ParsedOutput:
    state = parser.scan(text, final=True)
    calls = tuple(
        ToolCall(new_call_id(), c.name, c.arguments) for c in state.calls if c.name is not None
    )
    return ParsedOutput(state.content, calls)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    """A call's first delta: its index, id and name (arguments follow as ArgumentsDelta)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


StreamEvent = ContentDelta | CallStart | ArgumentsDelta


@dataclass
class _Sent:
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (id, arguments sent)


class ToolCallStream:
    """Feeds a parser text deltas and returns what became certain since the last push."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = _Sent()

    @property
    def call_ids(self) -> list[str]:
        return [call_id for call_id, _ in self._sent.calls]

    def push(self, delta: str, final: bool = False) -> list[StreamEvent]:
        self.text += delta
        state = self.parser.scan(self.text, final)
        events: list[StreamEvent] = []
        sent = self._sent
        if len(state.content) > len(sent.content):
            events.append(ContentDelta(state.content[len(sent.content) :]))
            sent.content = state.content
        for index, call in enumerate(state.calls):
            if call.name is None:
                break  # calls are sent in order: this one and the next wait for its name
            if index == len(sent.calls):
                sent.calls.append((new_call_id(), ""))
                events.append(CallStart(index, sent.calls[index][0], call.name))
            call_id, args_sent = sent.calls[index]
            if len(call.arguments) > len(args_sent):
                events.append(ArgumentsDelta(index, call.arguments[len(args_sent) :]))
                sent.calls[index] = (call_id, call.arguments)
        return events
