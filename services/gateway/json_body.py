"""A REST request's JSON body, read within the gateway's limits: its size (413 past
--max-request-body-bytes), its nesting (a body nested deeper than any API needs is a 400, never
a RecursionError's 500) and strict JSON (NaN / Infinity are not JSON numbers)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from kvmesh.errors import InvalidRequestError
from kvmesh.mesh.error_mapping import PayloadTooLargeError

MAX_DEPTH = 128  # objects and arrays inside each other; a deep tool schema uses a few dozen


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past `limit` bytes (declared or actual), 400 when not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(limit)
    return parse(bytes(body))


def parse(body: bytes | str) -> Any:
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    check_depth(value)
    return value


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """InvalidRequestError if `value` nests containers deeper than `limit` (iteratively)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    raise _too_deep()
                stack.append((child, depth + 1))


def _no_constant(name: str) -> Any:
    raise InvalidRequestError(f"the request body is not valid JSON: {name} is not a JSON number")


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"the request body nests objects and arrays deeper than {MAX_DEPTH}")


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"the request body exceeds {limit} bytes (--max-request-body-bytes)"
    )
