"""Tool-call parsers, one module per output format, chosen per model (`parser_for`) unless a
flag names one (`--tool-call-parser`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.agent.conversation import Tool
from kvmesh.agent.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCallStream,
    ToolParser,
    parse_output,
)
from kvmesh.agent.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from kvmesh.agent.tool_parsers.glm45 import Glm45Parser
from kvmesh.agent.tool_parsers.hermes import HermesParser
from kvmesh.agent.tool_parsers.kimi_k2 import KimiK2Parser
from kvmesh.agent.tool_parsers.llama3_json import Llama3JsonParser
from kvmesh.errors import InvalidRequestError

PARSERS: dict[str, type] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, KimiK2Parser, DeepSeekV3Parser, Glm45Parser)
}

# A marker of each format in a chat template, most specific first; a template with none of
# them gets the built-in tool template, whose format is hermes.
_MARKERS: tuple[tuple[str, str], ...] = (
    ("tool_calls_section_begin", "kimi_k2"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<arg_key>", "glm45"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
)


def get_parser(name: str, tools: Sequence[Tool] = ()) -> ToolParser:
    """The parser for one request (`tools`: the tools it offers)."""
    if name not in PARSERS:
        raise InvalidRequestError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name](tools)


def parser_for(chat_template: str | None) -> str:
    """The parser for a model's own chat template."""
    template = chat_template or ""
    return next((name for marker, name in _MARKERS if marker in template), "hermes")


__all__ = [
    "ArgumentsDelta",
    "CallStart",
    "ContentDelta",
    "ParsedOutput",
    "StreamEvent",
    "ToolCallStream",
    "ToolParser",
    "get_parser",
    "parse_output",
    "parser_for",
]
