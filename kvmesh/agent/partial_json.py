"""The longest valid reading of JSON text that was cut short (a tool call's arguments when the
reply hit max_tokens): an open string or container closed, a dangling key, comma or unfinished
literal dropped. Anthropic's clients read a cut tool_use's input this way."""

from __future__ import annotations

import json
import re
from typing import Any

_LITERAL = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null|-|[tfn][a-z]*")
_UNICODE_TAIL = re.compile(r"\\u[0-9a-fA-F]{0,3}$")  # a \\uXXXX escape cut in the middle


def partial_json(text: str) -> Any:
    """The value `text` begins, completed; None if not even its start reads as JSON."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    stack: list[str] = []
    key_next = False  # inside an object, where the next string is a key
    best: str | None = None  # the longest prefix that closes into valid JSON, closed
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == '"':
            end = _string_end(text, i)
            if end is None:  # cut inside the string: a value keeps what was written of it
                if not key_next:
                    best = _without_cut_escape(text) + '"' + _closers(stack)
                break
            i = end
            if not key_next:
                best = text[:i] + _closers(stack)
            key_next = False
            continue
        if char in "{[":
            stack.append(char)
            key_next = char == "{"
            best = text[: i + 1] + _closers(stack)
        elif char in "}]" and stack:
            stack.pop()
            best, key_next = text[: i + 1] + _closers(stack), False
        elif char == ",":
            key_next = bool(stack) and stack[-1] == "{"
        elif (match := _LITERAL.match(text, i)) is not None:
            i = match.end()
            candidate = text[:i] + _closers(stack)
            best = candidate if _valid(candidate) else best
            continue
        i += 1
    return json.loads(best) if best is not None and _valid(best) else None


def _string_end(text: str, start: int) -> int | None:
    """The index after the string opening at `start`, None if it never closes."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _without_cut_escape(text: str) -> str:
    """`text` (ending inside a string) without an escape sequence cut in the middle."""
    cut = _UNICODE_TAIL.search(text)
    if cut is not None and _odd_backslashes(text[: cut.start() + 1]):  # its \\ starts an escape
        return text[: cut.start()]
    return text[:-1] if _odd_backslashes(text) else text


def _odd_backslashes(text: str) -> bool:
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1


def _closers(stack: list[str]) -> str:
    return "".join("}" if opener == "{" else "]" for opener in reversed(stack))


def _valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
