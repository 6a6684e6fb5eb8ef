"""The Anthropic Messages and OpenAI Responses APIs through the package's mesh (etcd, gateway, 2
prefill + 2 decode) with the official anthropic and openai clients: greedy text equal to the
single-process engine, forced tool calls valid for their schema, whole and streamed alike,
every stream event in its place, count_tokens and the prompt cache in usage, a tool result
sent back and answered; a strict tool under tool_choice auto called through REST and gRPC alike
(the history's calls and results as proto fields); required choices streamed, parallel off."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from kvmesh import SamplingParams
from kvmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration import agent_schemas
from tests.integration.chat_client import client_for

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2-135m"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the anthropic client no longer types it: sent as an extra field


@pytest.fixture(scope="module")
def claude(mesh):
    import anthropic

    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{mesh.http_port}", api_key="unused", max_retries=0, timeout=120
    )


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
    tools = [
        {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}
    ]
    fields = dict(
        model=MODEL,
        max_tokens=48,
        messages=ASK,
        tools=tools,
        extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    whole = claude.messages.create(**fields)
    (use,) = [block for block in whole.content if block.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)
    with claude.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert json.loads("".join(deltas)) == use.input
    (streamed,) = [block for block in final.content if block.type == "tool_use"]
    assert (streamed.name, streamed.input, final.stop_reason) == (use.name, use.input, "tool_use")
    result = [
        {"role": "assistant", "content": whole.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}
            ],
        },
    ]
    answer = claude.messages.create(
        **{**fields, "tool_choice": {"type": "none"}, "messages": ASK + result}
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].text.strip()


def test_responses_function_tool_round_trip_whole_and_streamed(mesh):
    client = client_for(mesh)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather",
        "parameters": CITY,
        "strict": True,
    }
    fields = dict(
        model=MODEL,
        input=ASK[0]["content"],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=48,
        temperature=0,
    )
    whole = client.responses.create(**fields)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    events = list(client.responses.create(**fields, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    for begun, done in (
        ("response.output_item.added", "response.output_item.done"),
        ("response.function_call_arguments.delta", "response.function_call_arguments.done"),
    ):
        assert begun in kinds and done in kinds, kinds
    (streamed,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    follow_up = [
        ASK[0],
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    final = client.responses.create(
        model=MODEL, input=follow_up, tools=[tool], max_output_tokens=32, temperature=0
    )
    assert final.output_text.strip()


def _proto_message(message: dict) -> gateway_pb2.ChatMessage:
    calls = [
        gateway_pb2.ToolCall(
            id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]
        )
        for c in message.get("tool_calls") or []
    ]
    return gateway_pb2.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id", ""),
    )


def test_a_strict_tool_under_auto_is_called_through_rest_and_grpc(mesh, llm):
    """After three turns that called the tool, the model opens its reply with a call: the lazy
    trigger hands over to the strict tool's schema. The call equals the engine's, valid for the
    schema, whole and streamed; the same history sent to the gRPC Gateway as proto fields (calls,
    results with their ids) gives the same call; a result for no call is INVALID_ARGUMENT."""
    (case,) = [c for c in agent_schemas.cases() if c["name"] == "tools-currency"]
    body = {**agent_schemas.body(case), "messages": agent_schemas.called_history(case)}
    (want,) = agent_schemas.engine_answers(llm, [body])
    (got,) = agent_schemas.mesh_answers(client_for(mesh), [body])
    assert got == want and got.finish == "tool_calls" and len(got.calls) == 1, got
    agent_schemas.check(case, got)
    ((name, arguments),) = got.calls
    stream = client_for(mesh).chat.completions.create(**body, stream=True)
    deltas = [
        c.function for chunk in stream for d in chunk.choices for c in d.delta.tool_calls or []
    ]
    assert deltas[0].name == name and "".join(d.arguments or "" for d in deltas) == arguments
    tool = case["tools"][0]["function"]
    chat = gateway_pb2.ChatMessages(
        messages=[_proto_message(m) for m in body["messages"]],
        tools=[
            gateway_pb2.Tool(
                name=tool["name"],
                description=tool["description"],
                parameters_json=json.dumps(tool["parameters"]),
                strict=True,
            )
        ],
        tool_choice=gateway_pb2.ToolChoice(mode="auto"),
        parallel_tool_calls=False,
    )
    sampling = common_pb2.SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
    orphan = gateway_pb2.ChatMessages(
        messages=[
            *chat.messages[:2],
            gateway_pb2.ChatMessage(role="tool", tool_call_id="call_9", content="1.0"),
        ]
    )
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        pieces = [
            c
            for r in stub.Generate(
                gateway_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=300
            )
            for c in r.tool_calls
        ]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(gateway_pb2.GenerateRequest(chat=orphan), timeout=30))
    assert pieces[0].name == name and "".join(p.arguments for p in pieces) == arguments
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'messages[2]' is a tool result for call 'call_9'" in info.value.details()


def test_required_calls_streamed_and_whole_one_call_when_parallel_is_off(mesh):
    """tool_choice required over two tools with parallel_tool_calls false: exactly one call, the
    streamed deltas (index, id and name first, then argument text only) adding up to it."""
    tools = [
        {
            "type": "function",
            "function": {"name": name, "description": text, "parameters": CITY, "strict": True},
        }
        for name, text in (
            ("get_weather", "Current weather in a city"),
            ("get_time", "Local time in a city"),
        )
    ]
    fields = dict(
        model=MODEL,
        messages=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    client = client_for(mesh)
    whole = client.chat.completions.create(**fields).choices[0]
    (call,) = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    deltas = [
        d
        for chunk in client.chat.completions.create(**fields, stream=True)
        for choice in chunk.choices
        for d in choice.delta.tool_calls or []
    ]
    assert {d.index for d in deltas} == {0}
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == call.function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
