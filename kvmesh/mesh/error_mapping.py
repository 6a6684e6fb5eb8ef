"""The one place kvmesh errors become HTTP statuses, OpenAI error JSON and gRPC statuses (and back).

Over gRPC an error travels as (status code, details); `grpc_details` writes the details as
"<code>: <message>" so `error_from_grpc` can rebuild the exact typed error on the client side.
"""

from __future__ import annotations

import re
from typing import Any

import grpc

from kvmesh.errors import (
    AuthenticationError,
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    KvIntegrityError,
    KvmeshError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RequestAbortedError,
    WorkerUnavailableError,
)

# Codes of errors meaning "a part of the mesh is down or failed; retrying may succeed".
UNAVAILABLE_CODES = frozenset(
    {"worker_unavailable", "kv_transfer_failed", "discovery_unavailable", "etcd_unavailable"}
)
_GENERIC_MESSAGE = "internal server error"
_CODE_PREFIX = re.compile(r"\b([a-z][a-z0-9_]*): ")


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, WorkerUnavailableError) or (
        isinstance(exc, KvmeshError) and exc.code in UNAVAILABLE_CODES
    )


def http_status(exc: BaseException) -> int:
    """The HTTP status a REST front end answers with for `exc`."""
    if isinstance(exc, PayloadTooLargeError):
        return 413
    if isinstance(exc, OverloadedError):
        return 429
    if isinstance(exc, AuthenticationError):
        return 401
    if isinstance(exc, InvalidRequestError | CapacityError):
        return 400  # CapacityError: this request can never fit, so it is the request's fault
    if isinstance(exc, ModelNotFoundError):
        return 404
    if isinstance(exc, DeadlineExceededError):
        return 504
    if _is_unavailable(exc) or isinstance(exc, RequestAbortedError):
        return 503  # aborted on a worker, not by this caller: retrying may succeed
    return 500


def error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def openai_error_body(exc: BaseException) -> dict[str, Any]:
    """OpenAI error JSON for `exc`; a 500 never leaks the exception's text."""
    status = http_status(exc)
    if status == 500 and not (isinstance(exc, KvmeshError) and exc.expose):
        return error_body(_GENERIC_MESSAGE, "server_error", "internal_error")
    code = exc.code if isinstance(exc, KvmeshError) else None
    type_ = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return error_body(str(exc), type_, code)


_OPENAI_TYPES = {429: "rate_limit_error"}  # others: 4xx / 5xx (401: invalid_request_error)


def http_headers(exc: BaseException) -> dict[str, str]:
    """Headers an error response carries: Retry-After on 429."""
    if isinstance(exc, OverloadedError):
        return {"Retry-After": str(exc.retry_after_s)}
    return {}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(exc: BaseException) -> dict[str, Any]:
    """Anthropic's error JSON for `exc`: {"type": "error", "error": {"type", "message"}}."""
    status = http_status(exc)
    message = openai_error_body(exc)["error"]["message"]  # a 500's text stays generic
    error_type = _ANTHROPIC_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": error_type, "message": message}}


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a server aborts with for `exc`."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, AuthenticationError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, CapacityError | OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if _is_unavailable(exc):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, KvIntegrityError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(exc, RequestAbortedError):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, DeadlineExceededError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def grpc_details(exc: KvmeshError) -> str:
    """The details string to abort with, so `error_from_grpc` recovers the error type."""
    return f"{exc.code}: {exc}"


_FALLBACK_BY_STATUS: dict[grpc.StatusCode, type[KvmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.UNAVAILABLE: WorkerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.DATA_LOSS: KvIntegrityError,
}


def error_from_grpc(code: grpc.StatusCode, details: str) -> KvmeshError:
    """The typed error behind a failed gRPC call (the inverse of `grpc_status`)."""
    found = _class_in_details(code, details)
    if found is not None:
        cls, prefix = found
        return cls(details.replace(prefix, "", 1))
    return _FALLBACK_BY_STATUS.get(code, KvmeshError)(details or code.name.lower())


def error_from_code(code: str, message: str) -> KvmeshError:
    """The typed error for an in-band error code (a stream's `Error` message)."""
    return _error_classes().get(code, KvmeshError)(message)


def _class_in_details(code: grpc.StatusCode, details: str) -> tuple[type[KvmeshError], str] | None:
    """A "<code>: " prefix written by `grpc_details` whose class maps back to `code`."""
    by_code = _error_classes()
    for match in _CODE_PREFIX.finditer(details):
        cls = by_code.get(match.group(1))
        if cls is not None and grpc_status(cls.__new__(cls)) == code:
            return cls, match.group(0)
    return None


def _error_classes() -> dict[str, type[KvmeshError]]:
    """Every KvmeshError subclass imported so far, by code (the most general class wins)."""
    found: dict[str, type[KvmeshError]] = {}
    pending: list[type[KvmeshError]] = [KvmeshError]
    while pending:
        cls = pending.pop(0)
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found
