"""OpenAI's Responses API on the gateway through the official openai client: text and
function_call items whole and streamed (every *.done event), items in the input, formats."""

from __future__ import annotations

import json

import openai
import pytest

from tests.unit.fake_backend import ANSWER

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def served(openai_served):
    return openai_served


def test_text_whole_and_streamed(served, tok) -> None:
    client, backend = served
    reply = client.responses.create(
        model=MODEL, input="Capital of France?", instructions="Be brief."
    )
    assert reply.status == "completed" and reply.output_text == ANSWER
    assert reply.usage.input_tokens == len(backend.requests[-1].prompt_token_ids)
    assert "Be brief." in tok.decode(backend.requests[-1].prompt_token_ids)
    with client.responses.stream(model=MODEL, input="Capital of France?") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == ANSWER
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for done in (
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kinds.count(done) == 1, done


def test_function_calls_and_their_outputs(served, tok) -> None:
    client, backend = served
    backend.script(CALL)
    reply = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    message, call = reply.output
    assert message.type == "message" and message.content[0].text == "Sure."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER]) as s:
        events = list(s)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    follow_up = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    backend.script("It is 18 C.")
    final = client.responses.create(model=MODEL, input=follow_up, tools=[WEATHER])
    assert final.output_text == "It is 18 C."
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<tool_response>\n18 C\n</tool_response>" in prompt


def test_forced_choice_format_limits_and_errors(served) -> None:
    client, backend = served
    client.responses.create(
        model=MODEL,
        input="x",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert '"const": "get_weather"' in backend.requests[-1].params.grammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.responses.create(
        model=MODEL,
        input="x",
        text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
    )
    assert '"a"' in backend.requests[-1].params.grammar
    cut = client.responses.create(model=MODEL, input="x", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="'input"):
        client.responses.create(model=MODEL, input=[{"type": "image", "url": "x"}])
    orphan = {"type": "function_call_output", "call_id": "call_9", "output": "18 C"}
    with pytest.raises(openai.BadRequestError, match=r"'input\[1\]' is a tool result for call"):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": "x"}, orphan])
