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
    (
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        "",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}')],
    ),
    (
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
        "Let me check.",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}')],
    ),
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call>', "", [("now", "{}")]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    (
        '<tool_call>{"arguments": {"a": "}\\"{"}, "name": "late"}</tool_call>',
        "",
        [("late", '{"a": "}\\"{"}')],
    ),
    (
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
        "",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "parameters": {"y": "<tool_call>"}}</tool_call>',
        "",
        [("a", '{"x": 1}'), ("b", '{"y": "<tool_call>"}')],
    ),
    ('<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>', "", [("s", '{"q": 1}')]),
    ("a <b> c <tool_c", "a <b> c <tool_c", []),  # a tag that never came: content at the end
    ('<tool_call>{"name": "cut", "arguments": {"city": "Par', "", [("cut", '{"city": "Par')]),
]


KIMI = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>"
)
DEEPSEEK = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
    "<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
GLM = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    "<tool_call>now\n</tool_call>"
)
OTHER_CASES = [
    ("kimi_k2", "Sure. " + KIMI, "Sure.", [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    ("kimi_k2", "no calls <|tool", "no calls <|tool", []),
    (
        "deepseek_v3",
        "Let me see.\n" + DEEPSEEK,
        "Let me see.",
        [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
    ),
    (
        "glm45",
        "Checking " + GLM,
        "Checking",
        [("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}")],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "now", "parameters": {}}',
        "",
        [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
    ),
    ("llama3_json", '<|python_tag|>{"name": "now", "parameters": {}}', "", [("now", "{}")]),
    (
        "llama3_json",
        'Hello <|python_tag|>{"name": "now", "parameters": {}}',
        "Hello",
        [("now", "{}")],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON naming no function: content
    ("llama3_json", "Just words.", "Just words.", []),
]
ALL_CASES = [("hermes", *case) for case in HERMES_CASES] + OTHER_CASES


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_whole_output(parser, text, content, calls):
    parsed = parse_output(get_parser(parser), text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


def _stream(text: str, cuts: list[int], parser: str = "hermes"):
    stream = ToolCallStream(get_parser(parser))
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


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_stream_adds_up_whatever_the_split(parser, text, content, calls):
    for cut in range(len(text) + 1):  # two pieces at every point
        assert _assemble(_stream(text, [cut], parser)) == (content, calls), cut
    by_char = _stream(text, list(range(1, len(text))), parser)
    assert _assemble(by_char) == (content, calls)


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
    assert parser_for("<tool_call>{{ name }}<arg_key>") == "glm45"
    assert parser_for("<|tool_calls_section_begin|>") == "kimi_k2"
    assert parser_for("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert parser_for("{{ '<|python_tag|>' }}") == "llama3_json"
    with pytest.raises(InvalidRequestError, match="unknown tool-call parser"):
        get_parser("nope")
