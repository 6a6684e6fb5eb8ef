"""The tools of an OpenAI Responses request as the model sees them, and its calls as the client
expects them back (what Codex sends: see docs/internals.md, "The agent layer").

- `function` tools: offered as they are.
- `namespace` tools (`{"type": "namespace", "name": ns, "tools": [...]}`): each function or
  custom tool inside offered as `ns.name`; its calls go back as `name` with `"namespace": ns`.
- `custom` tools (free-form text input, optionally a Lark or regex format): offered as a function
  of one string argument `input`; its calls go back as `custom_tool_call` items with that text.
  The format is described to the model, not enforced.
- hosted tools the mesh cannot run (`web_search`, `file_search`, `code_interpreter`, ...):
  accepted, not offered; `not_offered` names them (a response header and a log line say so).

Tools come from the top-level `tools` and from `additional_tools` input items (Codex's
"responses lite" dialect), all offered from the start of the conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.errors import InvalidRequestError

CUSTOM_INPUT = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Offered:
    """One tool as the client named it: `namespace` None for a top-level tool."""

    name: str
    namespace: str | None = None
    custom: bool = False

    @property
    def model_name(self) -> str:
        return self.name if self.namespace is None else f"{self.namespace}.{self.name}"


@dataclass(frozen=True)
class ResponsesTools:
    functions: tuple[dict[str, Any], ...] = ()  # chat-shaped {"type": "function", ...}
    offered: dict[str, Offered] = field(default_factory=dict)  # by model name
    not_offered: tuple[str, ...] = ()  # hosted tool types, in request order

    @classmethod
    def of(cls, body: dict[str, Any]) -> ResponsesTools:
        groups = [("tools", body.get("tools") or [])]
        items = body.get("input")
        for i, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict) and item.get("type") == "additional_tools":
                groups.append((f"input[{i}].tools", item.get("tools") or []))
        catalog = _Catalog()
        for where, tools in groups:
            if not isinstance(tools, list):
                raise InvalidRequestError(f"'{where}' must be an array")
            for j, tool in enumerate(tools):
                catalog.add(f"{where}[{j}]", tool, None)
        return cls(tuple(catalog.functions), catalog.offered, tuple(catalog.hosted))

    def call_item(self, model_name: str, call_id: str, arguments: str) -> dict[str, Any]:
        """A call the model made as the client's output item (arguments as the model wrote)."""
        tool = self.offered.get(model_name, Offered(model_name))
        item: dict[str, Any] = {"call_id": call_id, "name": tool.name}
        if tool.namespace is not None:
            item["namespace"] = tool.namespace
        if tool.custom:
            return {"type": "custom_tool_call", **item, "input": custom_input(arguments)}
        return {"type": "function_call", **item, "arguments": arguments}

    def is_custom(self, model_name: str) -> bool:
        tool = self.offered.get(model_name)
        return tool is not None and tool.custom


def model_name(name: Any, namespace: Any) -> Any:
    """The name a past call of the client's (`name`, `namespace`) had for the model."""
    return f"{namespace}.{name}" if isinstance(namespace, str) and namespace else name


def custom_input(arguments: str) -> str:
    """A custom tool's text from the arguments object the model wrote ({"input": ...})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return (
        value["input"]
        if isinstance(value, dict) and isinstance(value.get("input"), str)
        else arguments
    )


class _Catalog:
    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.offered: dict[str, Offered] = {}
        self.hosted: list[str] = []

    def add(self, where: str, tool: Any, namespace: str | None) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise InvalidRequestError(f"'{where}.type' must be a string")
        if kind == "namespace" and namespace is None:
            name = _name(where, tool)
            children = tool.get("tools")
            if not isinstance(children, list):
                raise InvalidRequestError(f"'{where}.tools' must be an array")
            for k, child in enumerate(children):
                self.add(f"{where}.tools[{k}]", child, name)
        elif kind in ("function", "custom"):
            self._offer(where, tool, namespace, kind == "custom")
        elif namespace is None:
            self.hosted.append(kind)  # web_search, file_search, mcp, ...: nothing here runs them
        else:
            raise InvalidRequestError(f"'{where}.type' must be function or custom in a namespace")

    def _offer(self, where: str, tool: dict[str, Any], namespace: str | None, custom: bool) -> None:
        offered = Offered(_name(where, tool), namespace, custom)
        if offered.model_name in self.offered:
            raise InvalidRequestError(f"'{where}.name': tool {offered.model_name!r} appears twice")
        self.offered[offered.model_name] = offered
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequestError(f"'{where}.description' must be a string")
        function: dict[str, Any] = {"name": offered.model_name, "description": description}
        if custom:
            function["description"] = _custom_description(description, tool.get("format"))
            function["parameters"] = CUSTOM_INPUT
        else:
            function |= {k: tool[k] for k in ("parameters", "strict") if k in tool}
        self.functions.append({"type": "function", "function": function})


def _name(where: str, tool: dict[str, Any]) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"'{where}.name' is required")
    return name


def _custom_description(description: str, fmt: Any) -> str:
    """A custom tool's description with its input format, for the model to follow."""
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        return description + "\nIts input is free-form text."
    syntax, definition = fmt.get("syntax", "lark"), fmt.get("definition", "")
    return f"{description}\nIts input is text in this {syntax} grammar:\n{definition}"
