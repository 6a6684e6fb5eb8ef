"""OpenAI tool calling through the gateway: calls whole and streamed, stop strings that never cut
a call, tools rendered into the prompt, named and required choices, legacy functions."""

from __future__ import annotations

from typing import Any

import openai

from tests.unit.tool_requests import ARGS, ASK, TIME_TOOL, TWO_CALLS, WEATHER_TOOL, create


def test_calls_in_the_reply_whole_and_streamed(openai_served) -> None:
    client, backend = openai_served
    backend.script(TWO_CALLS)
    reply = create(client, tools=[WEATHER_TOOL, TIME_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", ARGS),
        ("get_time", "{}"),  # exactly the model's JSON, {} kept
    ]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)

    chunks = list(create(client, tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
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


def test_stop_strings_end_content_but_never_cut_a_call(openai_served) -> None:
    """A stop string inside a call's arguments does not apply (the call would be corrupt);
    one in the content before the calls ends the reply there."""
    client, backend = openai_served
    for stream in (False, True):
        backend.script(TWO_CALLS)
        reply = _collect(
            create(client, tools=[WEATHER_TOOL, TIME_TOOL], stop=["}", "C"], stream=stream)
        )
        assert reply == (
            "Let me look that up.",
            [("get_weather", ARGS), ("get_time", "{}")],
            "tool_calls",
        )
        backend.script(TWO_CALLS)
        reply = _collect(create(client, tools=[WEATHER_TOOL], stop=[" up"], stream=stream))
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


def test_tools_render_into_the_prompt_with_the_history(openai_served, tok) -> None:
    client, backend = openai_served
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "developer", "content": "Answer in one sentence."},
    ]
    create(client, messages=history, tools=[WEATHER_TOOL], parallel_tool_calls=False)
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert "Call at most one function" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert "Answer in one sentence." in prompt
    create(client, messages=history, tools=[WEATHER_TOOL], tool_choice="none")
    assert "<tools>" not in tok.decode(backend.requests[-1].prompt_token_ids)


def test_named_and_required_choices_send_a_grammar(openai_served) -> None:
    client, backend = openai_served
    backend.script('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>')
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = create(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named)
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Paris"}')
    grammar = backend.requests[-1].params.grammar
    assert '"const": "get_weather"' in grammar and "get_time" not in grammar
    assert "call)*" not in grammar  # named: that function, once
    create(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    grammar = backend.requests[-1].params.grammar
    assert "anyOf" in grammar and '"const": "get_time"' in grammar
    assert "call)*" in grammar  # required: parallel calls allowed...
    create(
        client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False
    )
    assert "call)*" not in backend.requests[-1].params.grammar  # ...unless turned off
    create(client, tools=[WEATHER_TOOL])  # auto, nothing strict: the model chooses freely
    assert backend.requests[-1].params.grammar is None
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    create(client, tools=[strict])  # auto with a strict tool: text, or calls that follow it
    grammar = backend.requests[-1].params.grammar
    assert "lead[lazy]: TEXT" in grammar and '"required": ["city"]' in grammar


def test_legacy_functions_map_onto_tools(openai_served, tok) -> None:
    client, backend = openai_served
    backend.script(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    reply = create(
        client, functions=[WEATHER_TOOL["function"]], function_call={"name": "get_weather"}
    )
    assert reply.choices[0].message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "Call at most one function" in prompt  # functions never ran in parallel


def test_text_reply_with_tools_is_plain_content(openai_served) -> None:
    client, backend = openai_served
    backend.script("It is sunny in Paris.")
    reply = create(client, tools=[WEATHER_TOOL])
    assert reply.choices[0].message.content == "It is sunny in Paris."
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(create(client, tools=[WEATHER_TOOL], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "It is sunny in Paris."
