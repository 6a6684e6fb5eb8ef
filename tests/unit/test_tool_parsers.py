"""Tool-call parsers: whole outputs, and streams split at every point adding up to them."""

from __future__ import annotations

import json

import pytest

from kvmesh.agent.tool_parsers import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
    get_parser,
    parse_output,
    parser_for,
)
from kvmesh.errors import InvalidRequestError

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'

HERMES_CASES = [
    # (output, content, [(name, arguments)])
    ("Just text, no call.", "Just text, no call.", []),
    ("Trailing space kept without a call  ", "Trailing space kept without a call  ", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call>', "", [("now", "{}")]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    ('<tool_call>{"arguments": {"a": "}\\"{"}, "name": "late"}</tool_call>', "",
     [("late", '{"a": "}\\"{"}')]),
    ('<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
     "", [("a", '{"x": 1}'), ("b", "{}")]),
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
     '<tool_call>{"name": "b", "parameters": {"y": "<tool_call>"}}</tool_call>', "",
     [("a", '{"x": 1}'), ("b", '{"y": "<tool_call>"}')]),
    ('<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>', "", [("s", '{"q": 1}')]),
    ('a <b> c <tool_c', "a <b> c <tool_c", []),  # a tag that never came: content at the end
    ('<tool_call>{"name": "cut", "arguments": {"city": "Par', "", [("cut", '{"city": "Par')]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole_output(text, content, calls):
    parsed = parse_output(get_parser("hermes"), text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


def _stream(text: str, cuts: list[int]):
    stream = ToolCallStream(get_parser("hermes"))
    events = []
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        events += stream.push(text[a:b], final=i == len(bounds) - 2)
    return events


def _assemble(events):
    content, calls = "", {}
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls), "calls start in order, each once"
            calls[event.index] = [event.name, ""]
        else:
            assert isinstance(event, ArgumentsDelta) and event.index in calls
            calls[event.index][1] += event.text
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_stream_adds_up_whatever_the_split(text, content, calls):
    for cut in range(len(text) + 1):  # two pieces at every point
        assert _assemble(_stream(text, [cut])) == (content, calls), cut
    assert _assemble(_stream(text, list(range(1, len(text))))) == (content, calls)  # by char


def test_stream_sends_name_first_then_only_new_argument_text():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    events = _stream(text, list(range(1, len(text))))
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "CallStart" and set(kinds[1:]) == {"ArgumentsDelta"}
    assert len(kinds) > 10  # the arguments came piece by piece, not at the end
    assert json.loads("".join(e.text for e in events[1:])) == {"city": "Paris", "days": [1, 2]}


def test_parser_registry():
    assert parser_for(None) == "hermes"
    assert parser_for("{% if tools %}<tool_call>{% endif %}") == "hermes"
    with pytest.raises(InvalidRequestError, match="unknown tool-call parser"):
        get_parser("nope")
