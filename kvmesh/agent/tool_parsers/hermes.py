"""Hermes / Qwen tool calls: one JSON object {"name", "arguments"} per <tool_call>...</tool_call>
(a JSON array of them inside one tag is accepted too); the text before the first tag is content.
This is also the format of kvmesh's built-in tool template (agent/templates.py)."""

from __future__ import annotations

import json

from kvmesh.agent.json_spans import ObjectScan, scan_object, skip_space
from kvmesh.agent.tool_parsers.base import CallState, ScanState, TaggedFormat
from kvmesh.agent.tool_parsers.tagged import Literal, certain_content, json_rule, quoted

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(TaggedFormat):
    name = "hermes"
    trigger = OPEN
    delimiters = (OPEN, CLOSE)

    def scan(self, text: str, final: bool) -> ScanState:
        first = text.find(OPEN)
        if first < 0:
            return ScanState(text if final else certain_content(text, OPEN))
        calls: list[CallState] = []
        at = first
        while at >= 0:
            body = at + len(OPEN)
            close = text.find(CLOSE, body)
            calls.extend(
                _calls(text[body : len(text) if close < 0 else close], close >= 0 or final)
            )
            if close < 0:
                break
            at = text.find(OPEN, close + len(CLOSE))
        return ScanState(text[:first].rstrip(), tuple(calls))

    def call_grammar(self, call_schema: dict, many: bool, literal: Literal = quoted) -> str:
        """After the first <tool_call>: {"name", "arguments"} per `call_schema` and the close
        tag; with `many`, more calls each in its own tags."""
        more = f' ("\\n" {literal(OPEN)} call)*' if many else ""
        return f'calls: call{more}\ncall: "\\n" {json_rule(call_schema)} "\\n" {literal(CLOSE)}\n'


def _calls(body: str, settled: bool) -> list[CallState]:
    """The calls in one tag's body: an object, or an array of objects."""
    j = skip_space(body, 0)
    if j >= len(body):
        return []
    if body[j] == "{":
        return [call_state(body, scan_object(body, j))]
    if body[j] != "[":
        return []
    calls = []
    j = skip_space(body, j + 1)
    while j < len(body) and body[j] == "{":
        scan = scan_object(body, j)
        calls.append(call_state(body, scan))
        if scan.end is None:
            break
        j = skip_space(body, scan.end)
        if j < len(body) and body[j] == ",":
            j = skip_space(body, j + 1)
    return calls


def call_state(body: str, scan: ObjectScan) -> CallState:
    """A {"name": ..., "arguments": {...}} object (or "parameters"), arguments as written."""
    name_member = scan.members.get("name")
    name = None
    if name_member is not None and name_member.end is not None:
        value = json.loads(name_member.raw(body)) if body[name_member.start] == '"' else None
        name = value if isinstance(value, str) else None
    complete = scan.end is not None
    args = scan.members.get("arguments") or scan.members.get("parameters")
    if args is None:
        return CallState(name, "{}" if complete else "", complete)
    if body[args.start] == '"':  # arguments given as a JSON string holding JSON
        if args.end is None:
            return CallState(name, "", False)
        value = json.loads(args.raw(body))
        return CallState(name, value if isinstance(value, str) else "", complete)
    return CallState(name, args.raw(body), complete)
