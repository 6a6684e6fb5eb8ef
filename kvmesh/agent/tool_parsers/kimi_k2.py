"""Kimi K2 tool calls: <|tool_calls_section_begin|>, then per call <|tool_call_begin|>
functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>, then
<|tool_calls_section_end|>; the text before the section is content."""

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

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class KimiK2Parser(TaggedFormat):
    name = "kimi_k2"
    trigger = SECTION
    delimiters = (SECTION, SECTION_END, CALL, ARGS, CALL_END)

    def scan(self, text: str, final: bool) -> ScanState:
        first = text.find(SECTION)
        if first < 0:
            return ScanState(text if final else certain_content(text, SECTION))
        calls, at = [], text.find(CALL, first)
        while at >= 0:
            header, named = until(text, at + len(CALL), ARGS, final)
            if not named:
                break  # the name is complete only once the arguments begin
            name = header.strip().removeprefix("functions.").rsplit(":", 1)[0]
            start = at + len(CALL) + len(header) + len(ARGS)
            arguments, closed = until(text, start, CALL_END, final)
            calls.append(CallState(name, arguments.strip(), closed))
            at = text.find(CALL, start + len(arguments)) if closed else -1
        return ScanState(text[:first].rstrip(), tuple(calls))

    def call_grammar(self, call_schema: dict, many: bool, literal: Literal = quoted) -> str:
        def call(name: str, arguments: dict) -> str:
            head = literal(CALL) + " " + json.dumps(f"functions.{name}:")
            return f"{head} /[0-9]+/ {literal(ARGS)} {json_rule(arguments)} {literal(CALL_END)}"

        return sections(literal(SECTION_END), options(call_schema, call), many)
