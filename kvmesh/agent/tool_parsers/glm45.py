"""GLM-4.5 tool calls: <tool_call>NAME, then per argument <arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>, then </tool_call>; arguments become a JSON object. A value is
text where the tool's schema types that argument as a string, else JSON where it parses as
JSON (a number, true, an object), else text."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvmesh.agent.conversation import Tool
from kvmesh.agent.grammars import within
from kvmesh.agent.tool_parsers.base import CallState, ScanState, TaggedFormat
from kvmesh.agent.tool_parsers.tagged import (
    Literal,
    certain_content,
    json_rule,
    options,
    quoted,
    until,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class Glm45Parser(TaggedFormat):
    name = "glm45"
    trigger = OPEN
    delimiters = (OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        super().__init__(tools)
        self._texts = {tool.name: _text_arguments(tool) for tool in tools}

    def scan(self, text: str, final: bool) -> ScanState:
        first = text.find(OPEN)
        if first < 0:
            return ScanState(text if final else certain_content(text, OPEN))
        calls, at = [], first
        while at >= 0:
            body, closed = until(text, at + len(OPEN), CLOSE, final)
            call = self._call(body, closed or final)
            if call is None:
                break
            calls.append(call)
            at = text.find(OPEN, at + len(OPEN) + len(body)) if closed else -1
        return ScanState(text[:first].rstrip(), tuple(calls))

    def call_grammar(self, call_schema: dict, many: bool, literal: Literal = quoted) -> str:
        """After the first <tool_call>: NAME, one key / value pair per line in the order of
        the tool's properties (the required ones always), then </tool_call>."""

        def call(name: str, arguments: dict) -> str:
            return f"{json.dumps(name + chr(10))} {_pairs(arguments, literal)} {literal(CLOSE)}"

        more = f' ("\\n" {literal(OPEN)} call)*' if many else ""
        text = f"value_text[lazy]: /(.|\\n)*/ {literal(VALUE_END)}\n"
        return f"calls: call{more}\ncall: {options(call_schema, call)}\n{text}"

    def _call(self, body: str, settled: bool) -> CallState | None:
        """NAME then <arg_key>/<arg_value> pairs: arguments grow pair by pair, `}` when closed."""
        name_end = min((i for i in (body.find("\n"), body.find(KEY)) if i >= 0), default=-1)
        if name_end < 0 and not settled:
            return None
        name = (body if name_end < 0 else body[:name_end]).strip()
        texts = self._texts.get(name, frozenset())
        pairs, at = [], body.find(KEY)
        while at >= 0:
            key_end = body.find(KEY_END, at)
            value_at = body.find(VALUE, key_end) if key_end >= 0 else -1
            value_end = body.find(VALUE_END, value_at) if value_at >= 0 else -1
            if value_end < 0:
                break
            key = body[at + len(KEY) : key_end].strip()
            value = body[value_at + len(VALUE) : value_end]
            pairs.append(
                f"{json.dumps(key)}: {json.dumps(value) if key in texts else _json(value)}"
            )
            at = body.find(KEY, value_end)
        arguments = "{" + ", ".join(pairs) + ("}" if settled else "")
        return CallState(name, arguments, settled)


def _json(text: str) -> str:
    try:
        json.loads(text)
    except ValueError:
        return json.dumps(text)
    return text.strip()


def _is_text(schema: object) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _text_arguments(tool: Tool) -> frozenset[str]:
    """The arguments the tool's schema types as strings (written as raw text)."""
    properties = tool.parameters.get("properties") or {}
    return frozenset(k for k, v in properties.items() if _is_text(v))


def _pairs(arguments: dict, literal: Literal) -> str:
    """The key / value lines of one tool's arguments: its properties in order (optional ones
    may be left out); a schema without properties takes any keys with text values."""
    between = f"{literal(KEY_END)} {json.dumps(chr(10))} {literal(VALUE)}"
    properties = arguments.get("properties") or {}
    if not properties:
        return f'({literal(KEY)} /[^<\\n]+/ {between} value_text "\\n")*'
    required = set(arguments.get("required") or ())
    lines = []
    for key, schema in properties.items():
        value = _value(within(schema, arguments), literal)
        line = f'{literal(KEY)} {json.dumps(key)} {between} {value} "\\n"'
        lines.append(line if key in required else f"({line})?")
    return " ".join(lines)


def _value(schema: dict, literal: Literal) -> str:
    """A string argument as raw text (one of its enum values where it has one); any other as
    JSON per its schema."""
    if _is_text(schema):
        assert isinstance(schema, dict)
        if isinstance(schema.get("enum"), list):
            choices = " | ".join(json.dumps(str(v)) for v in schema["enum"])
            return f"({choices}) {literal(VALUE_END)}"
        return "value_text"
    return f"{json_rule(schema)} {literal(VALUE_END)}"
