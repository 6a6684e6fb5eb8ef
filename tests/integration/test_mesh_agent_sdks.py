"""The Anthropic Messages and OpenAI Responses APIs through a real mesh (etcd, gateway, 1
prefill + 1 decode) with the official anthropic and openai clients: greedy text equal to the
single-process engine, forced tool calls valid for their schema, whole and streamed alike,
every stream event in its place, count_tokens and the prompt cache in usage, a tool result
sent back and answered."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh import SamplingParams
from kvmesh.mesh.launcher import UpOptions
from tests.integration.chat_client import client_for
from tests.integration.mesh_probes import running_mesh

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2-135m"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the anthropic client no longer types it: sent as an extra field


@pytest.fixture(scope="module")
def mesh():
    with running_mesh(UpOptions(prefill=1, decode=1, kvstore="none")) as running:
        yield running


@pytest.fixture(scope="module")
def claude(mesh):
    import anthropic

    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{mesh.http_port}", api_key="unused",
                               max_retries=0, timeout=120)  # fmt: skip


def test_anthropic_text_equals_the_engine_and_usage_counts(claude, llm):
    """Greedy text as the engine writes it, whole and streamed; count_tokens equal to the
    prompt the reply reports; the same long prompt again is read from the prefix cache."""
    question = "Tell me about the history of Paris. " * 12
    messages = [{"role": "user", "content": question}]
    llm.engine.block_manager.reset_prefix_cache()
    want = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0.0))[0].text
    fields = dict(model=MODEL, max_tokens=24, messages=messages, extra_body=GREEDY)
    whole = claude.messages.create(**fields)
    assert whole.content[0].text == want and whole.stop_reason == "max_tokens"
    counted = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert counted == whole.usage.input_tokens == len(llm.tokenizer.encode_chat(messages))
    with claude.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == want
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1, kinds
    assert final.usage.cache_read_input_tokens > 0  # the second time: from the prefix cache


def test_anthropic_forced_tool_use_whole_and_streamed(claude):
    tools = [{"name": "get_weather", "description": "Current weather in a city",
              "input_schema": CITY}]  # fmt: skip
    fields = dict(model=MODEL, max_tokens=48, messages=ASK, tools=tools, extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    whole = claude.messages.create(**fields)
    (use,) = [block for block in whole.content if block.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)
    with claude.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]  # fmt: skip
    assert json.loads("".join(deltas)) == use.input
    (streamed,) = [block for block in final.content if block.type == "tool_use"]
    assert (streamed.name, streamed.input, final.stop_reason) == (use.name, use.input, "tool_use")
    result = [{"role": "assistant", "content": whole.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]}]  # fmt: skip
    answer = claude.messages.create(**{**fields, "tool_choice": {"type": "none"},
                                       "messages": ASK + result})  # fmt: skip
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].text.strip()


def test_responses_function_tool_round_trip_whole_and_streamed(mesh):
    client = client_for(mesh)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": CITY, "strict": True}  # fmt: skip
    fields = dict(model=MODEL, input=ASK[0]["content"], tools=[tool], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=48, temperature=0)  # fmt: skip
    whole = client.responses.create(**fields)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    events = list(client.responses.create(**fields, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    for begun, done in (("response.output_item.added", "response.output_item.done"),
                        ("response.function_call_arguments.delta",
                         "response.function_call_arguments.done")):  # fmt: skip
        assert begun in kinds and done in kinds, kinds
    (streamed,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    follow_up = [ASK[0], {"type": "function_call", "call_id": call.call_id, "name": call.name,
                          "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]  # fmt: skip
    final = client.responses.create(model=MODEL, input=follow_up, tools=[tool],
                                    max_output_tokens=32, temperature=0)  # fmt: skip
    assert final.output_text.strip()
