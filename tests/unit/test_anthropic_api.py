"""Anthropic's Messages API on the gateway through the official anthropic client: text and
tool_use replies whole and streamed event by event, tool choices, history blocks,
count_tokens, stop sequences and errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest
from starlette.testclient import TestClient

from kvmesh.engine.tokenizer import Tokenizer
from services.gateway.openai_api import create_app
from services.gateway.served import ModelNames
from tests.unit.fake_backend import ANSWER, FakeBackend, cached_tokens_for, serve_app

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
CALLS = (
    "Checking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "units": ["C"]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture
def served(tok: Tokenizer) -> Iterator[tuple[anthropic.Anthropic, FakeBackend]]:
    backend = FakeBackend(tok, tokens_per_chunk=1)
    with serve_app(create_app(backend, tok)) as url:
        base = url.removesuffix("/v1")
        yield anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0), backend


def _create(client: anthropic.Anthropic, **fields):
    return client.messages.create(model=MODEL, **{"max_tokens": 200, "messages": ASK, **fields})


def test_text_reply_whole_and_streamed(served, tok) -> None:
    client, backend = served
    reply = _create(client, system="Be brief.")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == ANSWER
    assert reply.stop_reason == "end_turn" and reply.id.startswith("msg_")
    prompt = len(backend.requests[-1].prompt_token_ids)
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    assert usage.cache_read_input_tokens == cached_tokens_for(prompt)
    assert usage.output_tokens == len(backend.answer_ids) + 1
    assert "Be brief." in tok.decode(backend.requests[-1].prompt_token_ids)
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and kinds.count("content_block_start") == 1
    assert kinds.count("content_block_stop") == 1


def test_tool_use_blocks_whole_and_streamed(served) -> None:
    client, backend = served
    backend.script(CALLS)
    reply = _create(client, tools=[WEATHER, TIME])
    assert reply.stop_reason == "tool_use"
    assert [b.type for b in reply.content] == ["text", "tool_use", "tool_use"]
    text, weather, clock = reply.content
    assert text.text == "Checking."
    assert (weather.name, weather.input) == ("get_weather", {"city": "Paris", "units": ["C"]})
    assert (clock.name, clock.input) == ("get_time", {})
    assert weather.id.startswith("toolu_") and weather.id != clock.id
    with client.messages.stream(
        model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER, TIME]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "input", None)) for b in reply.content
    ]
    assert final.stop_reason == "tool_use"
    json_deltas = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(json_deltas) > 4  # the input streamed piece by piece
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1, 2]


def test_tool_choices_history_and_count_tokens(served, tok) -> None:
    client, backend = served
    _create(client, tools=[WEATHER, TIME], tool_choice={"type": "any"})
    assert "anyOf" in backend.requests[-1].params.grammar
    _create(client, tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"})
    assert '"const": "get_time"' in backend.requests[-1].params.grammar
    _create(client, tools=[WEATHER], tool_choice={"type": "none"})
    assert "<tools>" not in tok.decode(backend.requests[-1].prompt_token_ids)
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18 C"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    _create(client, messages=history, tools=[WEATHER])
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<tool_response>\n18 C\n</tool_response>" in prompt and "And tomorrow?" in prompt
    assert '"arguments": {"city": "Paris"}' in prompt and "I should call" not in prompt
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    assert counted.input_tokens == len(backend.requests[-1].prompt_token_ids)


def test_stop_sequence_reported(served) -> None:
    client, _ = served
    reply = _create(client, stop_sequences=["famous"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "famous"
    assert reply.content[0].text == ANSWER[: ANSWER.index("famous")]


BAD = [
    ({"max_tokens": None}, "'max_tokens' is required"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "'messages[0].content[0].type' 'image' is not supported",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "'messages[0].role' must be"),
    ({"tools": [{"name": "t"}]}, "'tools[0].input_schema'"),
    ({"tool_choice": {"type": "sometimes"}}, "'tool_choice' must be"),
    ({"temperature": 1.5}, "'temperature' must be a number in [0.0, 1.0]"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "18 C"}
                    ],
                }
            ]
        },
        "'messages[0].content[0]' is a tool result for call 'toolu_9'",
    ),
    (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
                    ],
                },
                {"role": "user", "content": "And?"},
            ]
        },
        "'messages[1]' made tool calls with no result before 'messages[2]': 'toolu_1'",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_requests_get_anthropic_errors(served, fields, message) -> None:
    client, _ = served
    body = {"model": MODEL, "max_tokens": 64, "messages": ASK, **fields}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post(
            "/v1/messages", cast_to=object, body={k: v for k, v in body.items() if v is not None}
        )
    error = info.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


# Claude Code 2.1.197's first request, its shape kept and its texts our own: a system message
# inside `messages`, `thinking`, `context_management`, `output_config`, `metadata`, cache_control
# on blocks, max_tokens far past the context, beta features the server does not know, a model id
# of its own, and HEAD / before it all.
CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24,some-future-beta-2031-01-01",
    "x-app": "cli",
}
CLAUDE_CODE_BODY = {
    "model": "claude-opus-4-8",
    "max_tokens": 64000,
    "stream": True,
    "system": [
        {"type": "text", "text": "x-billing: cc_version=2.1.197;"},
        {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>Today is 2026-12-07.</system-reminder>"},
                {"type": "text", "text": "say hi", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {"role": "system", "content": "Agent types available: claude, Explore."},
    ],
    "tools": [
        {
            "name": "Bash",
            "description": "Runs a shell command.",
            "input_schema": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
                "additionalProperties": False,
                "$schema": "https://json-schema.org/draft/2020-12/schema",
            },
        }
    ],
    "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}


def test_claude_codes_first_request_streams_to_the_end(tok) -> None:
    backend = FakeBackend(tok, tokens_per_chunk=3)
    app = create_app(backend, tok, names=ModelNames(any_model=True))
    with TestClient(app) as client:
        assert client.head("/").status_code == 200
        response = client.post(
            "/v1/messages?beta=true", json=CLAUDE_CODE_BODY, headers=CLAUDE_CODE_HEADERS
        )
        assert response.status_code == 200, response.text
        kinds = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "error" not in kinds
    left = backend.max_model_len - len(backend.requests[-1].prompt_token_ids)
    assert response.headers["x-kvmesh-max-tokens-clamped"] == f"64000->{left}"
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    # the system message stands where it was sent: after the user's turn, in a system turn
    said, mid = prompt.index("say hi"), prompt.index("Agent types available")
    assert said < mid and prompt.rindex("<|im_start|>system", 0, mid) > said


def test_output_config_format_is_the_reply_schema(served) -> None:
    """output_config.format (structured outputs): the reply is held to the schema."""
    client, backend = served
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    _create(
        client, extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    assert backend.requests[-1].params.grammar is not None
    _create(client, extra_body={"output_config": {"effort": "low"}})
    assert backend.requests[-1].params.grammar is None


def test_a_tool_use_cut_by_max_tokens_keeps_what_was_written(served, tok) -> None:
    client, backend = served
    backend.script(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": "celsius"}}\n</tool_call>'
    )
    cut = len(
        tok.encode(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "un',
            add_special_tokens=False,
        )
    )
    reply = _create(client, tools=[WEATHER], max_tokens=cut)
    assert reply.stop_reason == "max_tokens"
    (block,) = reply.content
    assert block.type == "tool_use" and block.input == {"city": "Paris"}
