"""The gateway's OpenAI REST front end when a request is wrong or a backend fails, and the
mapping of kvmesh errors to HTTP statuses, OpenAI error bodies and gRPC statuses."""

from __future__ import annotations

import json
from typing import Any

import anyio
import grpc
import pytest
from starlette.testclient import TestClient

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    KvIntegrityError,
    KvmeshError,
    ModelNotFoundError,
)
from kvmesh.mesh.error_mapping import (
    PayloadTooLargeError,
    WorkerUnavailableError,
    error_from_grpc,
    grpc_details,
    grpc_status,
    http_status,
    openai_error_body,
)
from services.gateway.limits import RequestLimits
from services.gateway.openai_api import create_app
from tests.unit.fake_backend import FakeBackend
from tests.unit.openai_app import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    MODEL,
    chat,
    client_id,
    events,
)

TOO_LONG = {"messages": [{"role": "user", "content": "Paris " * 2100}], "max_tokens": 5}


BAD_CHAT: list[tuple[Any, int, str, str]] = [
    (b"{not json", 400, "invalid_request_error", "not valid JSON"),
    ([1, 2], 400, "invalid_request_error", "JSON object"),
    ({"model": MODEL}, 400, "invalid_request_error", "'messages'"),
    ({"messages": "hi"}, 400, "invalid_request_error", "'messages' must be of type array"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error", "role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "invalid_request_error",
        "only text parts",
    ),
    ({"messages": MESSAGES, "model": "gpt-4o"}, 404, "model_not_found", "gpt-4o"),
    ({"messages": MESSAGES, "temperature": "hot"}, 400, "invalid_request_error", "'temperature'"),
    ({"messages": MESSAGES, "max_tokens": "5"}, 400, "invalid_request_error", "'max_tokens'"),
    ({"messages": MESSAGES, "stream": "yes"}, 400, "invalid_request_error", "'stream'"),
    ({"messages": MESSAGES, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": -3}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": MESSAGES, "temperature": 3}, 400, "invalid_request_error", "temperature"),
    ({"messages": MESSAGES, "top_p": 0}, 400, "invalid_request_error", "top_p"),
    ({"messages": MESSAGES, "n": 17}, 400, "invalid_request_error", "'n' must be in [1, 16]"),
    ({"messages": MESSAGES, "n": 2, "best_of": 3}, 400, "invalid_request_error", "best_of=n"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "invalid_request_error", "'logprobs'"),
    (
        {"messages": MESSAGES, "tools": [{"type": "function"}]},
        400,
        "invalid_request_error",
        "tools",
    ),
    ({"messages": MESSAGES, "stop": [""]}, 400, "invalid_request_error", "stop"),
    (
        {"messages": MESSAGES, "seed": 2**63},
        400,
        "invalid_request_error",
        "seed must be an integer in",
    ),
    ({"messages": MESSAGES, "seed": -(2**63) - 1}, 400, "invalid_request_error", "seed"),
    ({"messages": MESSAGES, "top_k": 2**31}, 400, "invalid_request_error", "top_k must be"),
    (
        {"messages": MESSAGES, "stream_options": {"include_usage": True}},
        400,
        "invalid_request_error",
        "stream_options",
    ),
    (TOO_LONG, 400, "context_length_exceeded", "maximum context length is 2048 tokens"),
    (
        {"messages": MESSAGES, "repetition_penalty": 1e308},
        400,
        "invalid_request_error",
        "repetition_penalty must be in (0, 100]",
    ),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "invalid_request_error",
        "NaN is not a JSON number",
    ),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}',
        400,
        "invalid_request_error",
        "Infinity is not a JSON number",
    ),
]


@pytest.mark.parametrize(("body", "status", "code", "fragment"), BAD_CHAT)
def test_bad_chat_request(
    client: TestClient, backend: FakeBackend, body: Any, status: int, code: str, fragment: str
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = client.post(CHAT, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] is None
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    assert backend.requests == []


def test_max_tokens_beyond_the_context_is_clamped(
    client: TestClient, backend: FakeBackend, tok: Tokenizer
) -> None:
    """Agents send max_tokens 32k-64k whatever the model: clamped to what the context leaves
    the prompt, and said in a header; the reply ends with `length` where it is reached."""
    prompt_len = len(tok.encode_chat(MESSAGES))
    response = chat(client, max_tokens=5000, ignore_eos=True)
    assert response.status_code == 200
    left = 2048 - prompt_len
    assert response.headers["x-kvmesh-max-tokens-clamped"] == f"5000->{left}"
    assert backend.requests[-1].params.max_tokens == left
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == left
    assert "x-kvmesh-max-tokens-clamped" not in chat(client, max_tokens=5).headers


def test_context_length_message(backend: FakeBackend, tok: Tokenizer) -> None:
    """--max-tokens-policy refuse: vLLM's answer, word for word."""
    app = create_app(backend, tok, RequestLimits(max_tokens_policy="refuse"))
    with TestClient(app) as client:
        message = chat(client, max_tokens=5000).json()["error"]["message"]
    prompt_len = len(tok.encode_chat(MESSAGES))
    assert message == (
        "This model's maximum context length is 2048 tokens. However, you requested "
        f"{prompt_len + 5000} tokens ({prompt_len} in the messages, 5000 in the completion). "
        "Please reduce the length of the messages or completion."
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": list(range(2048))}, "you requested 2049 tokens (2048 in your prompt; 1 for"),
        ({}, "'prompt' must be"),
        ({"prompt": ["a", "b"]}, "batches"),
        ({"prompt": [1, -1]}, "token ids outside"),
        ({"prompt": "hi", "logprobs": True}, "'logprobs' must be of type integer"),
        ({"prompt": "hi", "echo": "yes"}, "'echo' must be of type boolean"),
    ],
)
def test_bad_completion_request(client: TestClient, body: dict, fragment: str) -> None:
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


@pytest.mark.parametrize("chunked", [False, True])
def test_body_too_large(backend: FakeBackend, tok: Tokenizer, chunked: bool) -> None:
    payload = json.dumps({"messages": [{"role": "user", "content": "x" * 4096}]}).encode()
    content: Any = iter([payload[:1000], payload[1000:]]) if chunked else payload
    with TestClient(create_app(backend, tok, RequestLimits(max_body_bytes=1024))) as small:
        response = small.post(CHAT, content=content)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"


@pytest.mark.parametrize(
    ("failure", "status", "type_", "message"),
    [
        (WorkerUnavailableError("decode worker went away"), 503, "server_error", "went away"),
        (CapacityError("KV pool too small"), 400, "invalid_request_error", "too small"),
        (RuntimeError("secret detail"), 500, "server_error", "internal server error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_backend_error_before_output(
    client: TestClient,
    backend: FakeBackend,
    failure: Exception,
    status: int,
    type_: str,
    message: str,
    stream: bool,
) -> None:
    backend.failure, backend.fail_after_chunks = failure, 0
    response = chat(client, stream=stream)
    assert response.status_code == status
    assert response.json()["error"]["type"] == type_
    assert response.json()["error"]["message"] == message or message in response.text
    assert "secret" not in response.text


def test_error_after_stream_started(client: TestClient, backend: FakeBackend) -> None:
    backend.fail_after_chunks = 2
    response = client.post(
        CHAT, json={"messages": MESSAGES, "stream": True}, headers={"x-request-id": "mid-1"}
    )
    assert response.status_code == 200
    data = events(response)
    assert data[-1] == "[DONE]"
    assert data[-2]["error"]["code"] == "worker_unavailable"
    assert data[-3]["choices"][0]["delta"]["content"]  # some output got through first
    assert [client_id(r) for r in backend.aborted] == ["mid-1"]


def test_client_disconnect_aborts_backend(tok: Tokenizer, backend: FakeBackend) -> None:
    backend.hang_after_chunks = 1
    app = create_app(backend, tok)
    body = json.dumps({"messages": MESSAGES, "stream": True}).encode()
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"gone-1")]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict] = []

    async def run() -> None:
        got_output = anyio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await got_output.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and b"content" in message["body"]:
                got_output.set()

        with anyio.fail_after(10):
            await app(scope, receive, send)

    anyio.run(run)
    assert sent[0]["status"] == 200
    assert backend.aborted == backend.cancelled and client_id(backend.aborted[0]) == "gone-1"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("depth", [129, 3000])
def test_deep_nesting_is_a_400_on_every_endpoint(client: TestClient, path: str, depth: int) -> None:
    """RecursionError is not a ValueError: a body nested 3,000 deep was a 500."""
    body = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "nests objects and arrays deeper than 128" in response.text


# ---- other endpoints ----


MAPPING: list[tuple[Exception, int, grpc.StatusCode]] = [
    (InvalidRequestError("bad"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (ContextLengthError("long"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (PayloadTooLargeError("big"), 413, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError("who"), 404, grpc.StatusCode.NOT_FOUND),
    (CapacityError("full"), 400, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WorkerUnavailableError("down"), 503, grpc.StatusCode.UNAVAILABLE),
    (KvmeshError("oops"), 500, grpc.StatusCode.INTERNAL),
    (ValueError("oops"), 500, grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("exc", "status", "grpc_code"), MAPPING)
def test_error_mapping(exc: Exception, status: int, grpc_code: grpc.StatusCode) -> None:
    assert http_status(exc) == status
    assert grpc_status(exc) == grpc_code
    error = openai_error_body(exc)["error"]
    assert error["param"] is None
    if status == 500:
        assert error == {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    else:
        assert error["message"] == str(exc) and error["code"] == exc.code  # type: ignore[attr-defined]


def test_kv_integrity_is_a_data_loss_whose_message_reaches_the_client() -> None:
    exc = KvIntegrityError("request r1 aborted: KV page(s) [3] ...")
    assert http_status(exc) == 500
    assert grpc_status(exc) == grpc.StatusCode.DATA_LOSS
    assert openai_error_body(exc)["error"] == {
        "message": str(exc),
        "type": "server_error",
        "param": None,
        "code": "kv_integrity",
    }
    back = error_from_grpc(grpc.StatusCode.DATA_LOSS, f"decode d1: {grpc_details(exc)}")
    assert type(back) is KvIntegrityError


def test_kv_transfer_code_is_unavailable() -> None:
    class TransferFailed(KvmeshError):
        code = "kv_transfer_failed"

    assert http_status(TransferFailed("x")) == 503
    assert grpc_status(TransferFailed("x")) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(("exc", "status", "grpc_code"), MAPPING[:-1])
def test_error_from_grpc_round_trip(
    exc: Exception, status: int, grpc_code: grpc.StatusCode
) -> None:
    assert isinstance(exc, KvmeshError)
    back = error_from_grpc(grpc_code, f"prefill worker 10.0.0.1:50051: {grpc_details(exc)}")
    assert type(back) is type(exc)
    assert str(back) == f"prefill worker 10.0.0.1:50051: {exc}"


def test_error_from_grpc_without_code_prefix() -> None:
    assert type(error_from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "no")) is InvalidRequestError
    unavailable = error_from_grpc(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert http_status(unavailable) == 503
    assert type(error_from_grpc(grpc.StatusCode.INTERNAL, "boom")) is KvmeshError
    # A code prefix that disagrees with the status is not trusted.
    fake = error_from_grpc(grpc.StatusCode.INTERNAL, "invalid_request_error: x")
    assert type(fake) is KvmeshError
