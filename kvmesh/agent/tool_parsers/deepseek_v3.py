"""DeepSeek-V3 tool calls: <｜tool▁calls▁begin｜>, per call <｜tool▁call▁begin｜>function<｜tool▁sep｜>
NAME, a ```json fenced block of the arguments, <｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>
(V3.1's shorter NAME<｜tool▁sep｜>{JSON} calls are read too); the text before is content."""

from __future__ import annotations

import json

from kvmesh.agent.tool_parsers.base import CallState, ScanState, TaggedFormat
from kvmesh.agent.tool_parsers.tagged import (
    Literal,
    certain_content,
    json_rule,
    options,
    quoted,
    sections,
    until,
)

SECTION, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE, FENCE_END = "```json\n", "\n```"


class DeepSeekV3Parser(TaggedFormat):
    name = "deepseek_v3"
    trigger = SECTION
    delimiters = (SECTION, SECTION_END, CALL, SEP, CALL_END)

    def scan(self, text: str, final: bool) -> ScanState:
        first = text.find(SECTION)
        if first < 0:
            return ScanState(text if final else certain_content(text, SECTION))
        calls, at = [], text.find(CALL, first)
        while at >= 0:
            call, end = _call(text, at + len(CALL), final)
            if call is None:
                break
            calls.append(call)
            at = text.find(CALL, end) if call.complete else -1
        return ScanState(text[:first].rstrip(), tuple(calls))

    def call_grammar(self, call_schema: dict, many: bool, literal: Literal = quoted) -> str:
        def call(name: str, arguments: dict) -> str:
            head = f'{literal(CALL)} "function" {literal(SEP)} {json.dumps(name + chr(10) + FENCE)}'
            return f"{head} {json_rule(arguments)} {json.dumps(FENCE_END)} {literal(CALL_END)}"

        return sections(literal(SECTION_END), options(call_schema, call), many)


def _call(text: str, start: int, final: bool) -> tuple[CallState | None, int]:
    kind, has_sep = until(text, start, SEP, final)
    if not has_sep:
        return None, start
    body = start + len(kind) + len(SEP)
    if kind.strip() != "function":  # V3.1: NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>
        arguments, closed = until(text, body, CALL_END, final)
        return CallState(kind.strip(), arguments.strip(), closed), body + len(arguments)
    name, named = until(text, body, "\n", final)
    if not named:
        return None, start
    fence = body + len(name) + 1
    opened, has_fence = until(text, fence, FENCE, final)
    if not has_fence:
        return CallState(name.strip(), "", False), fence
    arguments, closed = until(text, fence + len(opened) + len(FENCE), FENCE_END, final)
    return CallState(name.strip(), arguments.strip(), closed), fence + len(opened) + len(arguments)
