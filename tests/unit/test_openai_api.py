"""The gateway's OpenAI REST front end over a scripted backend, and the error mapping."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import grpc
import openai
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
from services.gateway import openai_responses as resp
from services.gateway.limits import RequestLimits
from services.gateway.openai_api import create_app
from services.gateway.served import ModelNames
from tests.unit.fake_backend import ANSWER, FakeBackend, cached_tokens_for, serve_app

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def backend(tok: Tokenizer) -> FakeBackend:
    return FakeBackend(tok)


@pytest.fixture
def client(backend: FakeBackend, tok: Tokenizer) -> Iterator[TestClient]:
    with TestClient(create_app(backend, tok)) as test_client:
        yield test_client


def _client_id(mesh_id: str) -> str:
    """The client's request id inside the mesh id (`unique_request_id`: id + "." + 8 hex)."""
    client_id, dot, suffix = mesh_id.rpartition(".")
    assert dot and len(suffix) == 8, mesh_id
    return client_id


def chat(client: TestClient, **fields: Any) -> Any:
    return client.post(CHAT, json={"model": MODEL, "messages": MESSAGES, **fields})


def events(response: Any) -> list[Any]:
    """The SSE data payloads: JSON objects, and the final "[DONE]" string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def metric(client: TestClient, line_prefix: str) -> float:
    lines = client.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(line_prefix))


# ---- success paths ----


def test_chat_completion(client: TestClient, backend: FakeBackend, tok: Tokenizer) -> None:
    payload = {"model": MODEL, "messages": MESSAGES}
    response = client.post(CHAT, json=payload, headers={"x-request-id": "req-1"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-1"
    body = response.json()
    prompt = tok.encode_chat(MESSAGES)
    assert body["id"] == "chatcmpl-req-1"
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ANSWER},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(backend.answer_ids) + 1,  # + EOS
        "total_tokens": len(prompt) + len(backend.answer_ids) + 1,
        "prompt_tokens_details": {"cached_tokens": cached_tokens_for(len(prompt))},
    }
    sent = backend.requests[0]
    assert _client_id(sent.request_id) == "req-1" and sent.prompt_token_ids == prompt
    assert sent.params.max_tokens == 1024  # the default cap; the context has room for more
    assert backend.aborted == []


def test_chat_content_parts_and_sampling_fields(client: TestClient, backend: FakeBackend) -> None:
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "text", "text": "of France?"},
    ]
    fields = {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7}
    fields |= {"presence_penalty": 0.5, "frequency_penalty": 0.1, "repetition_penalty": 1.1}
    response = chat(client, messages=[{"role": "user", "content": parts}], **fields)
    assert response.status_code == 200, response.text
    params = backend.requests[0].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 40, 0.05)
    assert (params.seed, params.presence_penalty, params.repetition_penalty) == (7, 0.5, 1.1)
    assert response.headers["x-request-id"]  # generated


def test_max_tokens_gives_length(client: TestClient, backend: FakeBackend, tok: Tokenizer) -> None:
    body = chat(client, max_completion_tokens=5).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == tok.decode(backend.answer_ids[:5])
    assert body["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("as_ids", [False, True])
def test_completion(client: TestClient, backend: FakeBackend, tok: Tokenizer, as_ids: bool) -> None:
    ids = tok.encode("Paris is")
    prompt: Any = ids if as_ids else ["Paris is"]
    response = client.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt})
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert backend.requests[0].prompt_token_ids == ids


def test_chat_stream(client: TestClient, backend: FakeBackend, tok: Tokenizer) -> None:
    options = {"stream_options": {"include_usage": True}}
    data = events(chat(client, stream=True, **options))
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == ANSWER
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks[:-1])
    prompt_len = len(tok.encode_chat(MESSAGES))
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(backend.answer_ids) + 1
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_tokens_for(
        prompt_len
    )


def test_completion_stream(client: TestClient) -> None:
    response = client.post(COMPLETIONS, json={"prompt": "Paris is", "stream": True})
    data = events(response)
    assert data[-1] == "[DONE]"
    assert "usage" not in data[0]
    assert "".join(c["choices"][0]["text"] for c in data[:-1]) == ANSWER
    assert data[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_aborts(
    client: TestClient, backend: FakeBackend, stream: bool
) -> None:
    response = client.post(
        CHAT,
        json={"messages": MESSAGES, "stop": ["Paris", "Tower"], "stream": stream},
        headers={"x-request-id": "stop-1"},
    )
    if stream:
        chunks = events(response)[:-1]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text = response.json()["choices"][0]["message"]["content"]
        finish = response.json()["choices"][0]["finish_reason"]
    assert (text, finish) == ("The capital of France is ", "stop")
    assert [_client_id(r) for r in backend.aborted] == ["stop-1"]
    assert backend.requests[0].params.stop == ()  # the gateway, not the mesh, applies them


def test_include_stop_str_in_output(client: TestClient) -> None:
    body = chat(client, stop="France", include_stop_str_in_output=True).json()
    assert body["choices"][0]["message"]["content"] == "The capital of France"


def test_chat_logprobs(client: TestClient, backend: FakeBackend) -> None:
    body = chat(client, logprobs=True, top_logprobs=2, max_tokens=4).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert backend.requests[0].params.logprobs == 2
    assert len(content) == 4
    first = content[0]
    assert first["token"] == "The" and first["logprob"] == -0.25
    assert first["bytes"] == list(b"The")
    assert len(first["top_logprobs"]) == 2 and first["top_logprobs"][0]["token"] == "The"


def test_completion_logprobs_stream(client: TestClient) -> None:
    body = {"prompt": "Paris is", "logprobs": 1, "max_tokens": 6, "stream": True}
    chunks = [
        c for c in events(client.post(COMPLETIONS, json=body))[:-1] if c["choices"][0]["logprobs"]
    ]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert "".join(tokens) == "".join(c["choices"][0]["text"] for c in chunks)
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    top = chunks[0]["choices"][0]["logprobs"]["top_logprobs"][0]
    assert top == {tokens[0]: -0.25}


# ---- errors ----

TOO_LONG = {"messages": [{"role": "user", "content": "Paris " * 2100}], "max_tokens": 5}
BAD_CHAT: list[tuple[Any, int, str, str]] = [
    (b"{not json", 400, "invalid_request_error", "not valid JSON"),
    ([1, 2], 400, "invalid_request_error", "JSON object"),
    ({"model": MODEL}, 400, "invalid_request_error", "'messages'"),
    ({"messages": "hi"}, 400, "invalid_request_error", "'messages' must be of type array"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "invalid_request_error", "only text parts"),
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
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "invalid_request_error", "tools"),
    ({"messages": MESSAGES, "stop": [""]}, 400, "invalid_request_error", "stop"),
    ({"messages": MESSAGES, "seed": 2**63}, 400, "invalid_request_error", "seed must be an integer in"),
    ({"messages": MESSAGES, "seed": -(2**63) - 1}, 400, "invalid_request_error", "seed"),
    ({"messages": MESSAGES, "top_k": 2**31}, 400, "invalid_request_error", "top_k must be"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400,
     "invalid_request_error", "stream_options"),
    (TOO_LONG, 400, "context_length_exceeded", "maximum context length is 2048 tokens"),
    ({"messages": MESSAGES, "repetition_penalty": 1e308}, 400, "invalid_request_error",
     "repetition_penalty must be in (0, 100]"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "invalid_request_error", "NaN is not a JSON number"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}', 400,
     "invalid_request_error", "Infinity is not a JSON number"),
]  # fmt: skip


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
    client: TestClient, backend: FakeBackend, failure: Exception, status: int, type_: str,
    message: str, stream: bool,
) -> None:  # fmt: skip
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
    assert [_client_id(r) for r in backend.aborted] == ["mid-1"]


def test_client_disconnect_aborts_backend(tok: Tokenizer, backend: FakeBackend) -> None:
    backend.hang_after_chunks = 1
    app = create_app(backend, tok)
    body = json.dumps({"messages": MESSAGES, "stream": True}).encode()
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"gone-1")]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": CHAT,
             "raw_path": CHAT.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}  # fmt: skip
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
    assert backend.aborted == backend.cancelled and _client_id(backend.aborted[0]) == "gone-1"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("depth", [129, 3000])
def test_deep_nesting_is_a_400_on_every_endpoint(client: TestClient, path: str, depth: int) -> None:
    """RecursionError is not a ValueError: a body nested 3,000 deep was a 500."""
    body = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "nests objects and arrays deeper than 128" in response.text


# ---- other endpoints ----


def test_models_health_metrics_and_unknown_route(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [
        (MODEL, "model", "kvmesh")
    ]
    assert client.get("/health").json() == {"status": "ok"}
    ok = 'kvmesh_requests_total{outcome="ok",service="gateway"}'
    before = metric(client, ok)
    chat(client)
    assert metric(client, ok) == before + 1
    text = client.get("/metrics").text
    for name in ("kvmesh_request_ttft_seconds", "kvmesh_request_tpot_seconds",
                 "kvmesh_prompt_tokens_total", "kvmesh_prompt_cached_tokens_total",
                 "kvmesh_generation_tokens_total"):  # fmt: skip
        assert f"{name}" in text and 'service="gateway"' in text
    missing = client.get("/v1/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_served_model_names_and_any_model(backend: FakeBackend, tok: Tokenizer) -> None:
    """--served-model-name (several): each answers, the first is listed first and echoed when
    no model is named; the model's own name then is not served. --any-model: every name is."""
    names = ModelNames(("kimi", "kimi-fast"))
    with TestClient(create_app(backend, tok, names=names)) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["kimi", "kimi-fast"]
        assert chat(client, model="kimi-fast").json()["model"] == "kimi-fast"
        missing = chat(client, model=MODEL)
        assert missing.status_code == 404
        assert "this server serves `kimi`, `kimi-fast`" in missing.json()["error"]["message"]
        assert client.post(CHAT, json={"messages": MESSAGES}).json()["model"] == "kimi"
    with TestClient(create_app(backend, tok, names=ModelNames(any_model=True))) as client:
        assert chat(client, model="claude-haiku-4-5").json()["model"] == "claude-haiku-4-5"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]


# ---- the official openai client against a real server ----


@pytest.fixture
def served(tok: Tokenizer) -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend(tok)
    with serve_app(create_app(backend, tok)) as url:
        yield url, backend


def test_official_openai_client(served: tuple[str, FakeBackend]) -> None:
    url, backend = served
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == ANSWER
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.completion_tokens == len(backend.answer_ids) + 1
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3)  # type: ignore[arg-type]
    assert "temperature" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)  # type: ignore[arg-type]


# ---- the error mapping ----

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
        assert error == {"message": "internal server error", "type": "server_error",
                         "param": None, "code": "internal_error"}  # fmt: skip
    else:
        assert error["message"] == str(exc) and error["code"] == exc.code  # type: ignore[attr-defined]


def test_kv_integrity_is_a_data_loss_whose_message_reaches_the_client() -> None:
    exc = KvIntegrityError("request r1 aborted: KV page(s) [3] ...")
    assert http_status(exc) == 500
    assert grpc_status(exc) == grpc.StatusCode.DATA_LOSS
    assert openai_error_body(exc)["error"] == {"message": str(exc), "type": "server_error",
                                               "param": None, "code": "kv_integrity"}  # fmt: skip
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


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunks_event_is_the_chunk_body_of_its_text(kind: str, include_usage: bool) -> None:
    meta = resp.ResponseMeta(kind, "chatcmpl-1", "smollm2-135m", 123, include_usage)
    chunks = resp.TextChunks(meta, index=2)
    for text in ["Hello", ' "quoted" \\ \n\t', "\x00kvmesh-text\x00", "é漢字🙂", "\u2028", ""]:
        event = chunks.event(text)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event[6:]) == resp.chunk_body(meta, text, index=2)
