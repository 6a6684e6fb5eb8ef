"""Tool calls on /v1/chat/completions through the official openai client: the prompt the tools
render into, calls parsed from the reply (whole and streamed), forced tool choices, errors."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from services.gateway.openai_api import create_app
from tests.unit.fake_backend import FakeBackend

MODEL = "smollm2-135m"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}  # fmt: skip
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
ARGS = '{"city": "Paris", "units": {"t": "C"}}'
TWO_CALLS = (
    "Let me look that up.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture
def served(openai_served):
    return openai_served


def _create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, **fields})


def test_calls_in_the_reply_whole_and_streamed(served) -> None:
    client, backend = served
    backend.script(TWO_CALLS)
    reply = _create(client, tools=[WEATHER_TOOL, TIME_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", ARGS), ("get_time", "{}")  # exactly the model's JSON, {} kept
    ]  # fmt: skip
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)

    chunks = list(_create(client, tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
    content, streamed, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for call in delta.tool_calls or []:
            if call.index not in streamed:  # the first delta: index, id and name
                assert call.id and call.function.name and call.type == "function"
                streamed[call.index] = [call.function.name, call.function.arguments or ""]
            else:  # later ones: only new argument text
                assert call.id is None and call.function.name is None
                streamed[call.index][1] += call.function.arguments
    assert content == "Let me look that up." and finish == "tool_calls"
    assert [tuple(v) for v in streamed.values()] == [("get_weather", ARGS), ("get_time", "{}")]
    argument_deltas = sum(1 for c in chunks for t in c.choices[0].delta.tool_calls or [])
    assert argument_deltas > 6  # the arguments came token by token, not at the end


def test_stop_strings_end_content_but_never_cut_a_call(served) -> None:
    """A stop string inside a call's arguments does not apply (the call would be corrupt);
    one in the content before the calls ends the reply there."""
    client, backend = served
    for stream in (False, True):
        backend.script(TWO_CALLS)
        reply = _collect(_create(client, tools=[WEATHER_TOOL, TIME_TOOL], stop=["}", "C"],
                                 stream=stream))  # fmt: skip
        assert reply == ("Let me look that up.", [("get_weather", ARGS), ("get_time", "{}")],
                         "tool_calls")  # fmt: skip
        backend.script(TWO_CALLS)
        reply = _collect(_create(client, tools=[WEATHER_TOOL], stop=[" up"], stream=stream))
        assert reply == ("Let me look that", [], "stop")


def _collect(reply: Any) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a whole or streamed reply."""
    if not isinstance(reply, openai.Stream):
        message = reply.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return message.content or "", calls, reply.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in reply:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            name, args = calls.get(call.index, (call.function.name, ""))
            calls[call.index] = (name, args + (call.function.arguments or ""))
    return content, list(calls.values()), finish


def test_tools_render_into_the_prompt_with_the_history(served, tok) -> None:
    client, backend = served
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "developer", "content": "Answer in one sentence."},
    ]  # fmt: skip
    _create(client, messages=history, tools=[WEATHER_TOOL], parallel_tool_calls=False)
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert "Call at most one function" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert "Answer in one sentence." in prompt
    _create(client, messages=history, tools=[WEATHER_TOOL], tool_choice="none")
    assert "<tools>" not in tok.decode(backend.requests[-1].prompt_token_ids)


def test_named_and_required_choices_send_a_grammar(served) -> None:
    client, backend = served
    backend.script('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>')
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = _create(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named)
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Paris"}')
    grammar = backend.requests[-1].params.grammar
    assert '"const": "get_weather"' in grammar and "get_time" not in grammar
    assert "call)*" not in grammar  # named: that function, once
    _create(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    grammar = backend.requests[-1].params.grammar
    assert "anyOf" in grammar and '"const": "get_time"' in grammar
    assert "call)*" in grammar  # required: parallel calls allowed...
    _create(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
            parallel_tool_calls=False)  # fmt: skip
    assert "call)*" not in backend.requests[-1].params.grammar  # ...unless turned off
    _create(client, tools=[WEATHER_TOOL])  # auto, nothing strict: the model chooses freely
    assert backend.requests[-1].params.grammar is None
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    _create(client, tools=[strict])  # auto with a strict tool: text, or calls that follow it
    grammar = backend.requests[-1].params.grammar
    assert "lead[lazy]: TEXT" in grammar and '"required": ["city"]' in grammar


def test_legacy_functions_map_onto_tools(served, tok) -> None:
    client, backend = served
    backend.script(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    reply = _create(client, functions=[WEATHER_TOOL["function"]],
                    function_call={"name": "get_weather"})  # fmt: skip
    assert reply.choices[0].message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "Call at most one function" in prompt  # functions never ran in parallel


def test_text_reply_with_tools_is_plain_content(served) -> None:
    client, backend = served
    backend.script("It is sunny in Paris.")
    reply = _create(client, tools=[WEATHER_TOOL])
    assert reply.choices[0].message.content == "It is sunny in Paris."
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(_create(client, tools=[WEATHER_TOOL], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "It is sunny in Paris."


CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}  # fmt: skip
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}

BAD = [
    ({"tool_choice": "required"}, "tool_choice 'required' needs at least one tool"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "'x', which is not in 'tools'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "'tools[0].name'"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tool names must be unique"),
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "'parallel_tool_calls'"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "'messages[1].tool_call_id'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "'messages[0].tool_calls[0].function.name'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "'messages[0].role'"),
    ({"functions": [WEATHER_TOOL["function"]], "tools": [WEATHER_TOOL]}, "not both"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot both constrain"),
    ({"response_format": {"type": "xml"}}, "'response_format.type' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}},
     "'response_format.json_schema.schema' cannot be enforced"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "array", "uniqueItems": True}}}}, 'cannot be enforced: Unimplemented keys: ["uniqueItems"]'),
    ({"tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "pick", "strict": True,
        "parameters": {"type": "object", "not": {"required": ["a"]}}}}]},
     "'tools[1]' cannot be enforced: Unimplemented keys: [\"not\"]"),
    ({"tools": [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}}}],
      "tool_choice": "required"}, "'tools[0]' cannot be enforced: regex parse error"),
    ({"response_format": {"type": "grammar", "grammar": "start: nope"}},
     "'response_format.grammar' cannot be enforced"),
    ({"response_format": {"type": "choice", "choice": []}}, "'response_format.choice' must be"),
    ({"guided_regex": "[a-z]+", "response_format": {"type": "json_object"}}, "at most one of"),
    ({"guided_json": "{not json"}, "'guided_json' is not JSON"),
    ({"logit_bias": {"abc": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"99999999": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "'logit_bias[5]' must be a number in [-100, 100]"),
    # the history's order: results answer the calls of the assistant turn just before them
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "'messages[1]' is a tool result for call 'call_9', which is not an unanswered call"),
    ({"messages": [*ASK, CALLED, {"role": "user", "content": "And?"}]},
     "'messages[1]' made tool calls with no result before 'messages[2]': 'call_1'"),
    ({"messages": [*ASK, CALLED]}, "no result at the end of the conversation: 'call_1'"),
    ({"messages": [*ASK, CALLED, RESULT, RESULT]}, "'messages[3]' is a tool result for call 'call_1'"),
    ({"messages": [*ASK, CALLED, RESULT, {"role": "user", "content": "And?"}, RESULT]},
     "'messages[4]' is a tool result for call 'call_1'"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_tool_requests_are_400_naming_the_field(tok, fields, message) -> None:
    with TestClient(create_app(FakeBackend(tok), tok)) as client:
        response = client.post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


FORMATS = [
    ({"response_format": {"type": "json_object"}}, '"type":"object"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": True,
      "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}}}, '"city"'),
    ({"response_format": {"type": "regex", "regex": "[0-9]{3}"}}, "[0-9]{3}"),
    ({"response_format": {"type": "choice", "choice": ["yes", "no"]}}, '"yes" | "no"'),
    ({"response_format": {"type": "grammar", "grammar": 'start: "a"+'}}, 'start: "a"+'),
    ({"guided_choice": ["left", "right"]}, '"left" | "right"'),
    ({"response_format": {"type": "text"}}, None),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "marker"), FORMATS)
def test_output_formats_become_grammars(served, fields, marker) -> None:
    client, backend = served
    backend.script("{}")
    client.chat.completions.create(model=MODEL, messages=ASK, extra_body=fields)
    grammar = backend.requests[-1].params.grammar
    assert (
        grammar is None if marker is None else (marker.replace(" ", "") in grammar.replace(" ", ""))
    )


def test_logit_bias_reaches_the_sampling_params(served) -> None:
    client, backend = served
    client.chat.completions.create(model=MODEL, messages=ASK, logit_bias={"42": -100, "7": 5.5})
    assert backend.requests[-1].params.logit_bias == ((7, 5.5), (42, -100.0))


def test_echo_on_completions(served) -> None:
    client, backend = served
    backend.script(" Paris.")
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", echo=True)
    assert reply.choices[0].text == "The capital of France is Paris."
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is",
                                            echo=True, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[504, 3575], echo=True)
    assert ids.choices[0].text.endswith(" Paris.") and len(ids.choices[0].text) > len(" Paris.")
    for bad, message in (({"logprobs": 2}, "'echo' with 'logprobs'"),):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=MODEL, prompt="x", echo=True, **bad)
    with pytest.raises(openai.BadRequestError, match="only for /v1/completions"):
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"echo": True})


def test_n_choices_whole_and_streamed(served) -> None:
    client, backend = served
    reply = client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=5, temperature=1)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    requests = backend.requests[-3:]
    assert sorted(r.params.seed for r in requests) == [5, 6, 7]  # choices differ and replay
    assert len({r.request_id for r in requests}) == 3
    per_choice = len(backend.answer_ids) + 1
    assert reply.usage.completion_tokens == 3 * per_choice
    assert reply.usage.prompt_tokens == len(requests[0].prompt_token_ids)  # the prompt once
    stream = client.chat.completions.create(model=MODEL, messages=ASK, n=2, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
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


def test_a_failing_choice_ends_the_request_whole_and_streamed(served) -> None:
    client, backend = served
    backend.fail_after_chunks = 3
    with pytest.raises(openai.APIError, match="decode worker went away"):
        client.chat.completions.create(model=MODEL, messages=ASK, n=2)
    with pytest.raises(openai.APIError, match="decode worker went away"):  # in band, not a hang
        list(client.chat.completions.create(model=MODEL, messages=ASK, n=2, stream=True))


def test_template_special_tokens_are_not_content_beside_tools(served) -> None:
    """With tools offered the reply keeps its format's tags, never a chat template's own
    special tokens (<|im_start|>, <|endoftext|>) as text."""
    client, backend = served
    backend.script(
        "<|im_start|>assistant\nChecking.<|endoftext|>" + TWO_CALLS[len("Let me look that up.") :]
    )
    reply = _create(client, tools=[WEATHER_TOOL, TIME_TOOL]).choices[0]
    assert reply.message.content == "assistant\nChecking."
    assert [c.function.name for c in reply.message.tool_calls] == ["get_weather", "get_time"]
