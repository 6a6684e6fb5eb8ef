"""Where JSON values begin and end in text that may still be growing (a model's output so far).

Tool-call arguments are passed on exactly as the model wrote them, so parsers need the span of
a member's value in the raw text, not a re-serialised copy, and, while streaming, how much of
an unfinished value is already certain.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_PLAIN = re.compile(r'[^"{}\[\]]+')  # runs a nesting scan may skip
_SPACE = re.compile(r"\s*")
_SCALAR_END = re.compile(r"[,}\]\s]")


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()  # type: ignore[union-attr]


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None if the text ends first."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        match = _STRING.match(text, i)
        return match.end() if match else None
    if first not in "{[":
        match = _SCALAR_END.search(text, i)
        return match.start() if match else None
    depth, j = 0, i
    while j < len(text):
        char = text[j]
        if char == '"':
            match = _STRING.match(text, j)
            if match is None:
                return None
            j = match.end()
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        else:
            j = _PLAIN.match(text, j).end()  # type: ignore[union-attr]
            continue
        j += 1
    return None


@dataclass(frozen=True)
class Member:
    """A member of an object: its value's start, and end once the text holds all of it."""

    start: int
    end: int | None

    def raw(self, text: str) -> str:
        """The value's text so far (all of it once `end` is known)."""
        return text[self.start : len(text) if self.end is None else self.end]


@dataclass(frozen=True)
class ObjectScan:
    members: dict[str, Member]
    end: int | None  # after the closing brace; None while unfinished (or not JSON)


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the object that starts at text[i] ('{'), as far as the text goes."""
    members: dict[str, Member] = {}
    j = skip_space(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return ObjectScan(members, j + 1)
        key = _STRING.match(text, j)
        if key is None:
            return ObjectScan(members, None)
        colon = skip_space(text, key.end())
        if colon >= len(text):
            break
        if text[colon] != ":":
            return ObjectScan(members, None)
        start = skip_space(text, colon + 1)
        if start >= len(text):
            break
        end = value_end(text, start)
        members[json.loads(key.group())] = Member(start, end)
        if end is None:
            break
        j = skip_space(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_space(text, j + 1)
        elif j < len(text) and text[j] != "}":
            return ObjectScan(members, None)
    return ObjectScan(members, None)
