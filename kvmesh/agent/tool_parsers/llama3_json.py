"""Llama 3.1 / 3.2 JSON tool calls: the reply is {"name": ..., "parameters": {...}} objects
separated by ";" (optionally after <|python_tag|>); a reply that does not start with one is
content, up to a <|python_tag|> that starts calls."""

from __future__ import annotations

from kvmesh.agent.json_spans import scan_object, skip_space
from kvmesh.agent.tool_parsers.base import CallState, ScanState, TaggedFormat
from kvmesh.agent.tool_parsers.hermes import call_state
from kvmesh.agent.tool_parsers.tagged import Literal, certain_content, json_rule, options, quoted

TAG = "<|python_tag|>"


class Llama3JsonParser(TaggedFormat):
    name = "llama3_json"
    trigger = TAG
    delimiters = (TAG,)
    bare_calls = True

    def call_start(self, text: str) -> int:
        start = skip_space(text, 0)
        return start if text.startswith("{", start) else text.find(TAG)

    def scan(self, text: str, final: bool) -> ScanState:
        start = skip_space(text, 0)
        if start == len(text) or (not final and TAG.startswith(text[start:])):
            return ScanState("" if not final else text)  # nothing certain yet
        if text.startswith(TAG, start):
            start = skip_space(text, start + len(TAG))
        elif text[start] != "{":
            tag = text.find(TAG)
            if tag < 0:
                return ScanState(text if final else certain_content(text, TAG))
            return ScanState(text[:tag].rstrip(), _calls(text, skip_space(text, tag + len(TAG))))
        calls = _calls(text, start)
        if final and not any(call.name for call in calls):
            return ScanState(text)  # JSON that names no function: content after all
        return ScanState("", calls)

    def call_grammar(self, call_schema: dict, many: bool, literal: Literal = quoted) -> str:
        def call(name: str, arguments: dict) -> str:
            schema = {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": arguments},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            return json_rule(schema)

        more = ' ("; " call)*' if many else ""
        return f"calls: call{more}\ncall: {options(call_schema, call)}\n"


def _calls(text: str, at: int) -> tuple[CallState, ...]:
    calls = []
    while at < len(text) and text[at] == "{":
        scan = scan_object(text, at)
        calls.append(call_state(text, scan))
        if scan.end is None:
            break
        at = skip_space(text, scan.end)
        if at < len(text) and text[at] == ";":
            at = skip_space(text, at + 1)
    return tuple(calls)
