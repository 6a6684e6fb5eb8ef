"""Grammars for what a reply must be, in llguidance's formats (checked here, enforced by the
engine that samples: engine/runner/constraints.py): `response_format` json_object / json_schema, the
kvmesh extras regex / choice / Lark grammar (tool calls: agent/tool_grammar.py)."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.errors import InvalidRequestError

# JSON in json.dumps' style (", " and ": ", no other whitespace): what models write and what the
# tool template shows them, so drafts (EAGLE, n-gram) still match; flexible whitespace would
# let a small model spend every token on it
JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # oneOf held as anyOf (as xgrammar and Outlines do): exclusivity cannot be
    # enforced token by token, and draft-06/07 schemas use oneOf for plain unions
    "coerce_one_of": True,
}
_DEFINITIONS = ("$defs", "definitions")


def rooted(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """`schema` (a tool's arguments) placed inside a larger schema (a call's) with its `$ref`s
    still resolving against itself, not the larger one: given its own `$id` (a ref resolves
    against the nearest enclosing `$id`). Pydantic writes every nested model as a `$ref`."""
    if "$id" in schema or "$ref" not in json.dumps(schema):
        return schema
    return {"$id": f"urn:kvmesh:tool:{name}", **schema}


def within(part: Any, root: dict[str, Any]) -> dict[str, Any]:
    """`part` of `root` made to stand alone: root's `$defs` / `definitions` carried, so the refs
    into them resolve (a tool format that writes each argument's value on its own: glm45)."""
    if not isinstance(part, dict):
        return {}
    carried = {key: root[key] for key in _DEFINITIONS if key in root and key not in part}
    return {**part, **carried} if carried and "$ref" in json.dumps(part) else part


def json_schema(schema: dict[str, Any], field: str) -> str:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    return checked(grammar, field)


def regex(pattern: str, field: str) -> str:
    import llguidance

    return checked(llguidance.LLMatcher.grammar_from_regex(pattern), field)


def choice(options: list[str], field: str) -> str:
    if not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidRequestError(f"'{field}' must be a non-empty array of non-empty strings")
    return checked("start: " + " | ".join(json.dumps(o) for o in options) + "\n", field)


def lark(grammar: str, field: str) -> str:
    return checked(grammar, field)


def checked(grammar: str, field: str) -> str:
    """The grammar, if llguidance can use it; else a 400 naming the field and the reason."""
    import llguidance

    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if error:
        raise InvalidRequestError(f"'{field}' cannot be enforced: {'; '.join(messages)}")
    return grammar


def token_literals(hf_tokenizer: Any):
    """Delimiter -> Lark literal for this tokenizer: `<[id]>` where the delimiter is one
    added / special token (llguidance matches those by id only), else the quoted text."""
    added = getattr(hf_tokenizer, "get_added_vocab", dict)()

    def literal(tag: str) -> str:
        token = added.get(tag)
        return f"<[{token}]>" if token is not None else json.dumps(tag)

    return literal
