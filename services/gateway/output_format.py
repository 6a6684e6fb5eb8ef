"""What a reply must look like, from an OpenAI body: `response_format` text / json_object /
json_schema, the kvmesh types regex / choice / grammar (Lark), and vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` fields; as one llguidance grammar."""

from __future__ import annotations

from typing import Any

from kvmesh.agent import grammars
from kvmesh.errors import InvalidRequestError

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def output_grammar(body: dict[str, Any]) -> str | None:
    given = [name for name in _GUIDED if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequestError("'response_format' must be an object")
    constrained = fmt is not None and fmt.get("type") != "text"
    if len(given) + constrained > 1:
        raise InvalidRequestError(
            "at most one of 'response_format' (other than text), "
            + ", ".join(f"'{n}'" for n in _GUIDED)
        )
    if given:
        return _guided(given[0], body[given[0]])
    return _response_format(fmt) if constrained else None


def _response_format(fmt: dict[str, Any]) -> str:
    kind = fmt.get("type")
    if kind == "json_object":
        return grammars.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("'response_format.json_schema.schema' must be an object")
        return grammars.json_schema(schema, "response_format.json_schema.schema")
    if kind == "regex" and isinstance(fmt.get("regex"), str):
        return grammars.regex(fmt["regex"], "response_format.regex")
    if kind == "choice":
        return grammars.choice(fmt.get("choice"), "response_format.choice")  # type: ignore[arg-type]
    if kind == "grammar" and isinstance(fmt.get("grammar"), str):
        return grammars.lark(fmt["grammar"], "response_format.grammar")
    raise InvalidRequestError(
        "'response_format.type' must be text, json_object, json_schema (with 'json_schema'), "
        "regex (with 'regex'), choice (with 'choice') or grammar (with a Lark 'grammar')"
    )


def _guided(name: str, value: Any) -> str:
    if name == "guided_json":
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(f"'guided_json' is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise InvalidRequestError("'guided_json' must be a JSON schema object")
        return grammars.json_schema(value, name)
    if name == "guided_choice":
        return grammars.choice(value, name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{name}' must be a string")
    return grammars.regex(value, name) if name == "guided_regex" else grammars.lark(value, name)
