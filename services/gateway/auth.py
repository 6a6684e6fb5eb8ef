"""API keys at the gateway (`--api-key`, `--api-keys-file`): every /v1/ request must present one
(`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`), and so must every call of the
gRPC Gateway service (`authorization: Bearer <key>` metadata); else 401 in the API's own error
shape (OpenAI `invalid_api_key`, Anthropic `authentication_error`) / gRPC UNAUTHENTICATED.
Health, liveness and metrics stay open (probes carry no key). Keys are kept as SHA-256 digests
and never logged."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

import grpc
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh import env
from kvmesh.errors import AuthenticationError, InvalidRequestError
from kvmesh.mesh.error_mapping import anthropic_error_body, grpc_details, openai_error_body

_ANTHROPIC_PATHS = ("/v1/messages",)


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(key) for key in keys]
        if not self._digests:
            raise InvalidRequestError("no API key given (an empty keys file?)")

    @classmethod
    def of(cls, keys: Iterable[str], keys_file: str | None) -> ApiKeys | None:
        """From --api-key (repeatable), the environment's KVMESH_API_KEYS (one per line: how
        `kvmesh up` passes them, out of `ps`) and --api-keys-file (a key per line; blank lines
        and `#` comments skipped); None when none is given (no authentication)."""
        given = [*keys, *env.api_keys()]
        if any(not key.strip() for key in given):
            raise InvalidRequestError("--api-key is empty (an unset variable?)")
        if keys_file:
            path = Path(keys_file)
            if not path.is_file():
                raise InvalidRequestError(f"--api-keys-file {path} does not exist")
            lines = (line.strip() for line in path.read_text().splitlines())
            given += [line for line in lines if line and not line.startswith("#")]
        return cls(given) if given or keys_file else None

    def allows(self, key: str | None) -> bool:
        if not key:
            return False
        digest = _digest(key)
        return any(hmac.compare_digest(digest, known) for known in self._digests)

    def check(self, headers: Mapping[str, str]) -> None:
        """AuthenticationError unless `headers` carry one of the keys."""
        key = presented_key(headers)
        if not self.allows(key):
            raise AuthenticationError(
                "missing API key" if key is None else "incorrect API key provided"
            )


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def tenant_salt(headers: Mapping[str, str]) -> str:
    """The prompt-cache salt of the caller's key (Bearer or x-api-key; "" without one): each
    key's prompts share cached pages only among themselves."""
    key = presented_key(headers)
    return "" if key is None else "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def request_salt(headers: Mapping[str, str], client_salt: str = "") -> str:
    """A request's prompt-cache salt: its tenant's (tenant_salt), partitioned further by the
    client's own salt (x-kvmesh-cache-salt) inside that tenant, never across tenants: a salt a
    client sends can never equal another key's salt, nor another key's salt with that text."""
    tenant = tenant_salt(headers)
    return f"{tenant}/client:{client_salt}" if client_salt else tenant


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeyMiddleware:
    """Refuses /v1/ requests without a valid key before anything reads their body."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/v1/"):
            try:
                self.keys.check(Headers(scope=scope))
            except AuthenticationError as exc:
                anthropic = path.startswith(_ANTHROPIC_PATHS)
                body = anthropic_error_body(exc) if anthropic else openai_error_body(exc)
                headers = {"www-authenticate": "Bearer"}
                await JSONResponse(body, status_code=401, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The same check for the gRPC Gateway service (health and reflection stay open)."""

    def __init__(self, keys: ApiKeys, service: str) -> None:
        self.keys = keys
        self.prefix = f"/{service}/"

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        try:
            self.keys.check(dict(details.invocation_metadata or ()))
        except AuthenticationError as exc:
            return _refusal(handler, exc)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, exc: AuthenticationError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, grpc_details(exc))

    async def deny_stream(request, context):
        await deny(request, context)
        yield  # pragma: no cover - an async generator; abort raised above

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codecs)
    return grpc.unary_unary_rpc_method_handler(deny, **codecs)
