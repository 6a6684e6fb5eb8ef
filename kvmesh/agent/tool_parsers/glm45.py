"""GLM-4.5 tool calls: <tool_call>NAME, then per argument <arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>, then </tool_call>; arguments become a JSON object (a value that
is JSON -- a number, true, an object -- is kept as such, any other text is a string)."""

from __future__ import annotations

import json

from kvmesh.agent.tool_parsers.base import CallState, ScanState
from kvmesh.agent.tool_parsers.tagged import Literal, certain_content, quoted, until
from kvmesh.errors import InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class Glm45Parser:
    name = "glm45"

    def scan(self, text: str, final: bool) -> ScanState:
        first = text.find(OPEN)
        if first < 0:
            return ScanState(text if final else certain_content(text, OPEN))
        calls, at = [], first
        while at >= 0:
            body, closed = until(text, at + len(OPEN), CLOSE, final)
            call = _call(body, closed or final)
            if call is None:
                break
            calls.append(call)
            at = text.find(OPEN, at + len(OPEN) + len(body)) if closed else -1
        return ScanState(text[:first].rstrip(), tuple(calls))

    def call_grammar(self, call_schema: dict, many: bool, literal: Literal = quoted) -> str:
        raise InvalidRequestError(
            "tool_choice required / named is not available for the glm45 tool-call format yet "
            "(its arguments are key / value tags, not JSON); use tool_choice auto"
        )


def _call(body: str, settled: bool) -> CallState | None:
    """NAME then <arg_key>/<arg_value> pairs: arguments grow pair by pair, `}` when closed."""
    name_end = min((i for i in (body.find("\n"), body.find(KEY)) if i >= 0), default=-1)
    if name_end < 0 and not settled:
        return None
    name = (body if name_end < 0 else body[:name_end]).strip()
    pairs, at = [], body.find(KEY)
    while at >= 0:
        key_end = body.find(KEY_END, at)
        value_at = body.find(VALUE, key_end) if key_end >= 0 else -1
        value_end = body.find(VALUE_END, value_at) if value_at >= 0 else -1
        if value_end < 0:
            break
        key = body[at + len(KEY) : key_end].strip()
        pairs.append(f"{json.dumps(key)}: {_value(body[value_at + len(VALUE) : value_end])}")
        at = body.find(KEY, value_end)
    arguments = "{" + ", ".join(pairs) + ("}" if settled else "")
    return CallState(name, arguments, settled)


def _value(text: str) -> str:
    try:
        json.loads(text)
    except ValueError:
        return json.dumps(text)
    return text.strip()
