"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`): every REST endpoint with its request
body, the sampling fields the gateway reads, and the error responses it gives -- what clients
and fuzzers (schemathesis) go by. Limits configured on the gateway appear as schema bounds."""

from __future__ import annotations

from typing import Any

from services.gateway.limits import RequestLimits

_NUMBER = {"type": "number"}
_INT = {"type": "integer"}
_STOP = {
    "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
}
_TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
    },
}
_CHAT_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, _TEXT_PARTS, {"type": "null"}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "strict": {"type": "boolean"},
            },
        },
    },
}


def _sampling(
    model: str, limits: RequestLimits, max_tokens_names: tuple[str, ...]
) -> dict[str, Any]:
    """The sampling fields shared by the OpenAI endpoints."""
    tokens = {"type": "integer", "minimum": 1}
    if limits.max_output_tokens:
        tokens["maximum"] = limits.max_output_tokens
    fields: dict[str, Any] = {name: tokens for name in max_tokens_names}
    fields |= {
        name: _NUMBER
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
    }
    fields |= {
        "top_k": _INT,
        "seed": _INT,
        "ignore_eos": {"type": "boolean"},
        "stop": _STOP,
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object"},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n},
        "logit_bias": {"type": "object", "additionalProperties": _NUMBER},
        "user": {"type": "string"},
        "model": {"enum": [model]},
    }
    return fields


def _schemas(model: str, limits: RequestLimits) -> dict[str, Any]:
    chat = _sampling(model, limits, ("max_tokens", "max_completion_tokens"))
    chat |= {
        "messages": {"type": "array", "items": _CHAT_MESSAGE, "minItems": 1},
        "tools": {"type": "array", "items": _TOOL},
        "tool_choice": {},
        "parallel_tool_calls": {"type": "boolean"},
        "response_format": {"type": "object"},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer"},
    }
    completion = _sampling(model, limits, ("max_tokens",))
    completion |= {
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array"}]},
        "echo": {"type": "boolean"},
        "logprobs": {"type": "integer"},
    }
    responses = _sampling(model, limits, ("max_output_tokens",))
    responses |= {
        "input": {"oneOf": [{"type": "string"}, {"type": "array"}]},
        "instructions": {"type": "string"},
        "tools": {"type": "array"},
        "text": {"type": "object"},
    }
    messages = {
        "model": {"enum": [model]},
        "messages": {"type": "array", "minItems": 1},
        "system": {},
        "max_tokens": _sampling(model, limits, ("max_tokens",))["max_tokens"],
        "temperature": _NUMBER,
        "top_p": _NUMBER,
        "top_k": _INT,
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "stream": {"type": "boolean"},
        "tools": {"type": "array"},
        "tool_choice": {},
    }
    return {
        "ChatCompletionRequest": _object(chat, ["messages"]),
        "CompletionRequest": _object(completion, ["prompt"]),
        "ResponseRequest": _object(responses, ["input"]),
        "MessagesRequest": _object(messages, ["model", "messages", "max_tokens"]),
        "CountTokensRequest": _object(
            {k: messages[k] for k in ("model", "messages", "system", "tools")}, ["messages"]
        ),
        "Error": _object(
            {
                "error": _object(
                    {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {},
                        "code": {"type": ["string", "null"]},
                    },
                    ["message", "type"],
                )
            },
            ["error"],
        ),
        "AnthropicError": _object(
            {
                "type": {"const": "error"},
                "error": _object(
                    {"type": {"type": "string"}, "message": {"type": "string"}}, ["type", "message"]
                ),
            },
            ["type", "error"],
        ),
    }


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


def _errors(schema: str, codes: tuple[int, ...]) -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
    return {str(code): {"description": f"error {code}", **ref} for code in codes}


_POST_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)


def _post(summary: str, request: str, error: str = "Error") -> dict[str, Any]:
    body = {"$ref": f"#/components/schemas/{request}"}
    ok = {
        "description": "the result (JSON), or server-sent events when stream is true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    return {
        "post": {
            "summary": summary,
            "operationId": request,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": ok, **_errors(error, _POST_ERRORS)},
        }
    }


def _get(summary: str, operation: str, errors: tuple[int, ...] = ()) -> dict[str, Any]:
    ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "get": {
            "summary": summary,
            "operationId": operation,
            "responses": {"200": ok, **_errors("Error", errors)},
        }
    }


def openapi_document(model: str, limits: RequestLimits, version: str) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvmesh gateway",
            "version": version,
            "description": f"OpenAI- and Anthropic-compatible API serving {model}",
        },
        "paths": {
            "/v1/chat/completions": _post("OpenAI chat completion", "ChatCompletionRequest"),
            "/v1/completions": _post("OpenAI text completion", "CompletionRequest"),
            "/v1/responses": _post("OpenAI Responses", "ResponseRequest"),
            "/v1/messages": _post("Anthropic Messages", "MessagesRequest", "AnthropicError"),
            "/v1/messages/count_tokens": _post(
                "Anthropic token count", "CountTokensRequest", "AnthropicError"
            ),
            "/v1/models": _get("the served model", "listModels", (401,)),
            "/health": _get("readiness: 200 once a request would succeed", "health", (503,)),
            "/live": _get("liveness", "live"),
        },
        "components": {
            "schemas": _schemas(model, limits),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }
