"""The hostile bodies a generator rarely writes, sent to every REST endpoint of a live gateway:
JSON nested thousands deep, NaN / Infinity literals and numbers at the float's edge in every
numeric field, and the tool schemas pydantic writes (nested models as `$defs` + `$ref`,
recursive models, discriminated unions as `oneOf`, draft-06 `definitions`) under every tool
choice. What counts is what `kvmesh bench fuzz` counts: no 5xx, no hang."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx

from kvmesh_apps.benchmarks.fuzz_report import REST_TIMEOUT_S, FuzzReport

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
NUMERIC = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "seed",
)
EDGES = ("NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1e-320", "18446744073709551617")


def fuzz_edges(
    base_url: str, model: str, headers: dict[str, str] | None = None, quick: bool = False
) -> FuzzReport:
    """Every case once (`quick`: a sample, for the test suite); a 5xx, a hang or a dropped
    connection is a failure."""
    report = FuzzReport()
    started = time.monotonic()
    with httpx.Client(base_url=base_url, headers=headers, timeout=REST_TIMEOUT_S) as client:
        for label, path, body in cases(model, quick):
            report.requests += 1
            try:
                response = client.post(
                    path, content=body, headers={"content-type": "application/json"}
                )
            except httpx.HTTPError as exc:
                report.fail(f"{label}: no answer: {exc!r}")
                continue
            report.outcomes[response.status_code] += 1
            if response.status_code >= 500:
                report.fail(f"{label} -> {response.status_code}: {response.text[:300]}")
    report.seconds = time.monotonic() - started
    return report


def cases(model: str, quick: bool = False) -> Iterator[tuple[str, str, bytes]]:
    """(label, path, raw body) for every case (`quick`: each kind on fewer fields)."""
    for path in ENDPOINTS:
        for depth in (129, 3000, 100_000):
            yield f"{path} nested {depth}", path, _nested(model, path, depth)
        for name in NUMERIC[:3] if quick else NUMERIC:
            for edge in EDGES[:4] if quick else EDGES:
                yield f"{path} {name}={edge}", path, _with_number(model, path, name, edge)
    for label, schema in tool_schemas():
        for choice in ("required", "strict") if quick else ("auto", "required", "named", "strict"):
            for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
                body = _with_tool(model, path, schema, choice)
                yield f"{path} tool {label} {choice}", path, json.dumps(body).encode()


def tool_schemas() -> list[tuple[str, dict[str, Any]]]:
    """Schemas as pydantic writes them, and a draft-06 one with `definitions` and `oneOf`."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str | None = None

    class Trip(pydantic.BaseModel):
        origin: City
        stops: list[City]

    class Node(pydantic.BaseModel):
        label: str
        children: list[Node] = []

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        meows: bool

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        barks: int

    class Pet(pydantic.BaseModel):
        pet: Cat | Dog = pydantic.Field(discriminator="kind")

    draft06 = {
        "$schema": "http://json-schema.org/draft-06/schema#",
        "definitions": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "object", "properties": {"y": {"type": "string"}}},
        },
        "type": "object",
        "properties": {"v": {"oneOf": [{"$ref": "#/definitions/a"}, {"$ref": "#/definitions/b"}]}},
    }
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"d": deep}, "required": ["d"]}
    return [
        ("nested", Trip.model_json_schema()),
        ("recursive", Node.model_json_schema()),
        ("discriminated", Pet.model_json_schema()),
        ("draft06", draft06),
        ("deep40", deep),
    ]


def _base(model: str, path: str) -> dict[str, Any]:
    ask = [{"role": "user", "content": "hi"}]
    if path == "/v1/completions":
        return {"model": model, "prompt": "hi", "max_tokens": 4}
    if path == "/v1/responses":
        return {"model": model, "input": "hi", "max_output_tokens": 4}
    return {"model": model, "messages": ask, "max_tokens": 4}


def _nested(model: str, path: str, depth: int) -> bytes:
    body = json.dumps(_base(model, path))[:-1]
    return (body + ', "metadata": ' + "[" * depth + "]" * depth + "}").encode()


def _with_number(model: str, path: str, name: str, literal: str) -> bytes:
    body = {k: v for k, v in _base(model, path).items() if k != name}
    return (json.dumps(body)[:-1] + f', "{name}": {literal}}}').encode()


def _with_tool(model: str, path: str, schema: dict[str, Any], choice: str) -> dict[str, Any]:
    body = _base(model, path)
    strict = choice == "strict"
    if path == "/v1/messages":
        tool = {"name": "f", "input_schema": schema, "strict": strict}
        picks = {"required": {"type": "any"}, "named": {"type": "tool", "name": "f"}}
        return {**body, "tools": [tool], "tool_choice": picks.get(choice, {"type": "auto"})}
    function = {"name": "f", "parameters": schema, "strict": strict}
    if path == "/v1/responses":
        picks = {"required": "required", "named": {"type": "function", "name": "f"}}
        return {
            **body,
            "tools": [{"type": "function", **function}],
            "tool_choice": picks.get(choice, "auto"),
        }
    picks = {"required": "required", "named": {"type": "function", "function": {"name": "f"}}}
    return {
        **body,
        "tools": [{"type": "function", "function": function}],
        "tool_choice": picks.get(choice, "auto"),
    }
