"""Helpers for formats that wrap calls in tags: the text before a tag as content, sections
between tags, and tails held back while they may still turn into a tag."""

from __future__ import annotations

import json
from collections.abc import Callable

from kvmesh.agent.grammars import JSON_STYLE

Literal = Callable[[str], str]  # a delimiter -> its Lark literal (a special token: by id)


def quoted(tag: str) -> str:
    """A delimiter matched as text."""
    return json.dumps(tag)


def json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def options(call_schema: dict, call: Callable[[str, dict], str]) -> str:
    """One Lark alternative per tool of a forced call's schema (tool_call_schema)."""
    tools = call_schema.get("anyOf", [call_schema])
    return " | ".join(
        "(" + call(t["properties"]["name"]["const"], t["properties"]["arguments"]) + ")"
        for t in tools
    )


def sections(end: str, call: str, many: bool) -> str:
    """After the section's begin tag: one call (or several) then its END."""
    more = " call*" if many else ""
    return f"calls: call{more} {end}\ncall: {call}\n"


def held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def certain_content(text: str, tag: str) -> str:
    """Text that stays content whatever follows: without a suffix that may begin `tag`, and
    without trailing whitespace (dropped if a call follows)."""
    return text[: len(text) - held(text, tag)].rstrip()


def until(text: str, start: int, tag: str, final: bool) -> tuple[str, bool]:
    """text[start:] up to `tag` (exclusive) and whether the tag was found; while the text may
    still grow, without a tail that may begin the tag."""
    end = text.find(tag, start)
    if end >= 0:
        return text[start:end], True
    if final:
        return text[start:], False
    return text[start : len(text) - held(text[start:], tag)], False
