"""The gateway's OpenAI REST front end over a scripted backend: chat and completions, streamed
and not, logprobs, stop strings, models and names, the official openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from kvmesh.engine.tokenizer import Tokenizer
from services.gateway import openai_responses as resp
from services.gateway.openai_api import create_app
from services.gateway.served import ModelNames
from tests.unit.fake_backend import ANSWER, FakeBackend, cached_tokens_for, serve_app
from tests.unit.openai_app import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    MODEL,
    chat,
    client_id,
    events,
    metric,
)


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
    assert client_id(sent.request_id) == "req-1" and sent.prompt_token_ids == prompt
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
    assert [client_id(r) for r in backend.aborted] == ["stop-1"]
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
    for name in (
        "kvmesh_request_ttft_seconds",
        "kvmesh_request_tpot_seconds",
        "kvmesh_prompt_tokens_total",
        "kvmesh_prompt_cached_tokens_total",
        "kvmesh_generation_tokens_total",
    ):
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


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunks_event_is_the_chunk_body_of_its_text(kind: str, include_usage: bool) -> None:
    meta = resp.ResponseMeta(kind, "chatcmpl-1", "smollm2-135m", 123, include_usage)
    chunks = resp.TextChunks(meta, index=2)
    for text in ["Hello", ' "quoted" \\ \n\t', "\x00kvmesh-text\x00", "é漢字🙂", "\u2028", ""]:
        event = chunks.event(text)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event[6:]) == resp.chunk_body(meta, text, index=2)
