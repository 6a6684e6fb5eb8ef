"""Tool requests the gateway refuses (400 naming the field), output formats as grammars, logit
bias, echo, n choices and a failing choice, special tokens beside tools."""

from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from services.gateway.openai_api import create_app
from tests.unit.fake_backend import FakeBackend
from tests.unit.tool_requests import ASK, MODEL, TIME_TOOL, TWO_CALLS, WEATHER_TOOL, create

CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}


RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}


BAD = [
    ({"tool_choice": "required"}, "tool_choice 'required' needs at least one tool"),
    (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "'x', which is not in 'tools'",
    ),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "'tools[0].name'"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tool names must be unique"),
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "'parallel_tool_calls'"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "'messages[1].tool_call_id'"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
        "'messages[0].tool_calls[0].function.name'",
    ),
    ({"messages": [{"role": "robot", "content": "x"}]}, "'messages[0].role'"),
    ({"functions": [WEATHER_TOOL["function"]], "tools": [WEATHER_TOOL]}, "not both"),
    (
        {
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "cannot both constrain",
    ),
    ({"response_format": {"type": "xml"}}, "'response_format.type' must be"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}},
        "'response_format.json_schema.schema' cannot be enforced",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
            }
        },
        'cannot be enforced: Unimplemented keys: ["uniqueItems"]',
    ),
    (
        {
            "tools": [
                WEATHER_TOOL,
                {
                    "type": "function",
                    "function": {
                        "name": "pick",
                        "strict": True,
                        "parameters": {"type": "object", "not": {"required": ["a"]}},
                    },
                },
            ]
        },
        "'tools[1]' cannot be enforced: Unimplemented keys: [\"not\"]",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "pick",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(?=a)"}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },
        "'tools[0]' cannot be enforced: regex parse error",
    ),
    (
        {"response_format": {"type": "grammar", "grammar": "start: nope"}},
        "'response_format.grammar' cannot be enforced",
    ),
    ({"response_format": {"type": "choice", "choice": []}}, "'response_format.choice' must be"),
    ({"guided_regex": "[a-z]+", "response_format": {"type": "json_object"}}, "at most one of"),
    ({"guided_json": "{not json"}, "'guided_json' is not JSON"),
    ({"logit_bias": {"abc": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"99999999": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "'logit_bias[5]' must be a number in [-100, 100]"),
    # the history's order: results answer the calls of the assistant turn just before them
    (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
        "'messages[1]' is a tool result for call 'call_9', which is not an unanswered call",
    ),
    (
        {"messages": [*ASK, CALLED, {"role": "user", "content": "And?"}]},
        "'messages[1]' made tool calls with no result before 'messages[2]': 'call_1'",
    ),
    ({"messages": [*ASK, CALLED]}, "no result at the end of the conversation: 'call_1'"),
    (
        {"messages": [*ASK, CALLED, RESULT, RESULT]},
        "'messages[3]' is a tool result for call 'call_1'",
    ),
    (
        {"messages": [*ASK, CALLED, RESULT, {"role": "user", "content": "And?"}, RESULT]},
        "'messages[4]' is a tool result for call 'call_1'",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_tool_requests_are_400_naming_the_field(tok, fields, message) -> None:
    with TestClient(create_app(FakeBackend(tok), tok)) as client:
        response = client.post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


FORMATS = [
    ({"response_format": {"type": "json_object"}}, '"type":"object"'),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "w",
                    "strict": True,
                    "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        },
        '"city"',
    ),
    ({"response_format": {"type": "regex", "regex": "[0-9]{3}"}}, "[0-9]{3}"),
    ({"response_format": {"type": "choice", "choice": ["yes", "no"]}}, '"yes" | "no"'),
    ({"response_format": {"type": "grammar", "grammar": 'start: "a"+'}}, 'start: "a"+'),
    ({"guided_choice": ["left", "right"]}, '"left" | "right"'),
    ({"response_format": {"type": "text"}}, None),
]


@pytest.mark.parametrize(("fields", "marker"), FORMATS)
def test_output_formats_become_grammars(openai_served, fields, marker) -> None:
    client, backend = openai_served
    backend.script("{}")
    client.chat.completions.create(model=MODEL, messages=ASK, extra_body=fields)
    grammar = backend.requests[-1].params.grammar
    assert (
        grammar is None if marker is None else (marker.replace(" ", "") in grammar.replace(" ", ""))
    )


def test_logit_bias_reaches_the_sampling_params(openai_served) -> None:
    client, backend = openai_served
    client.chat.completions.create(model=MODEL, messages=ASK, logit_bias={"42": -100, "7": 5.5})
    assert backend.requests[-1].params.logit_bias == ((7, 5.5), (42, -100.0))


def test_echo_on_completions(openai_served) -> None:
    client, backend = openai_served
    backend.script(" Paris.")
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", echo=True)
    assert reply.choices[0].text == "The capital of France is Paris."
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[504, 3575], echo=True)
    assert ids.choices[0].text.endswith(" Paris.") and len(ids.choices[0].text) > len(" Paris.")
    for bad, message in (({"logprobs": 2}, "'echo' with 'logprobs'"),):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=MODEL, prompt="x", echo=True, **bad)
    with pytest.raises(openai.BadRequestError, match="only for /v1/completions"):
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"echo": True})


def test_n_choices_whole_and_streamed(openai_served) -> None:
    client, backend = openai_served
    reply = client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=5, temperature=1)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    requests = backend.requests[-3:]
    assert sorted(r.params.seed for r in requests) == [5, 6, 7]  # choices differ and replay
    assert len({r.request_id for r in requests}) == 3
    per_choice = len(backend.answer_ids) + 1
    assert reply.usage.completion_tokens == 3 * per_choice
    assert reply.usage.prompt_tokens == len(requests[0].prompt_token_ids)  # the prompt once
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, n=2, stream=True, stream_options={"include_usage": True}
    )
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 2 * per_choice
    assert texts == {0: reply.choices[0].message.content, 1: reply.choices[0].message.content}
    assert finishes == {0: "stop", 1: "stop"}
    completions = client.completions.create(model=MODEL, prompt="Paris is", n=2, best_of=2)
    assert [c.index for c in completions.choices] == [0, 1]


def test_a_failing_choice_ends_the_request_whole_and_streamed(openai_served) -> None:
    client, backend = openai_served
    backend.fail_after_chunks = 3
    with pytest.raises(openai.APIError, match="decode worker went away"):
        client.chat.completions.create(model=MODEL, messages=ASK, n=2)
    with pytest.raises(openai.APIError, match="decode worker went away"):  # in band, not a hang
        list(client.chat.completions.create(model=MODEL, messages=ASK, n=2, stream=True))


def test_template_special_tokens_are_not_content_beside_tools(openai_served) -> None:
    """With tools offered the reply keeps its format's tags, never a chat template's own
    special tokens (<|im_start|>, <|endoftext|>) as text."""
    client, backend = openai_served
    backend.script(
        "<|im_start|>assistant\nChecking.<|endoftext|>" + TWO_CALLS[len("Let me look that up.") :]
    )
    reply = create(client, tools=[WEATHER_TOOL, TIME_TOOL]).choices[0]
    assert reply.message.content == "assistant\nChecking."
    assert [c.function.name for c in reply.message.tool_calls] == ["get_weather", "get_time"]
