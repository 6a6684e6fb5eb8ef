"""The Responses API as Codex CLI 0.171.0 speaks it (shapes captured from it, texts our own):
its default "responses lite" dialect (tools in an `additional_tools` input item, `namespace`
groups, a free-form `custom` tool, a `configuration_update` item), the dialect it uses for other
model ids (top-level tools with a namespace and a hosted `web_search`), its WebSocket attempt,
and the history it sends back after a call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from services.gateway.openai_api import create_app
from services.gateway.served import ModelNames
from tests.unit.fake_backend import ANSWER, FakeBackend

JS_GRAMMAR = {
    "type": "grammar",
    "syntax": "lark",
    "definition": "start: SOURCE\nSOURCE: /[\\s\\S]+/",
}
WAIT = {
    "type": "function",
    "name": "wait",
    "description": "Wait for a cell.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cell_id": {"type": "string"}},
        "required": ["cell_id"],
        "additionalProperties": False,
    },
}
SLEEP = {
    "type": "function",
    "name": "sleep",
    "description": "Sleep.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"ms": {"type": "integer"}}},
}
LITE = {
    "model": "gpt-6.2-sol",
    "stream": True,
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "low", "context": "all_turns"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "thread-1",
    "text": {"verbosity": "low"},
    "client_metadata": {"session_id": "thread-1"},
    "input": [
        {
            "type": "additional_tools",
            "id": "at_1",
            "role": "developer",
            "tools": [
                {
                    "type": "namespace",
                    "name": "functions",
                    "description": "",
                    "tools": [
                        {
                            "type": "custom",
                            "name": "exec",
                            "description": "Run JavaScript.",
                            "format": JS_GRAMMAR,
                        },
                        WAIT,
                    ],
                },
                {"type": "namespace", "name": "clock", "description": "", "tools": [SLEEP]},
            ],
        },
        {
            "type": "message",
            "id": "msg_1",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are a coding agent."}],
            "internal_chat_message_metadata_passthrough": {"turn_id": "t1"},
        },
        {
            "type": "message",
            "id": "msg_2",
            "role": "user",
            "content": [{"type": "input_text", "text": "say hi"}],
            "internal_chat_message_metadata_passthrough": {"turn_id": "t1"},
        },
        {"type": "configuration_update", "reasoning": {"effort": "low"}},
    ],
}
EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "strict": False,
    "description": "Runs a command.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}
NON_LITE = {
    "model": "tinymodel",
    "stream": True,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are a coding agent."}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    ],
    "tools": [
        EXEC_COMMAND,
        {
            "type": "namespace",
            "name": "multi_agent_v1",
            "description": "Agents.",
            "tools": [{**SLEEP, "name": "wait_agent"}],
        },
        {"type": "web_search", "external_web_access": False},
    ],
}


@pytest.fixture
def codex(tok):
    backend = FakeBackend(tok, tokens_per_chunk=3)
    with TestClient(create_app(backend, tok, names=ModelNames(any_model=True))) as client:
        yield client, backend


def _events(response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
    ]


def _done_items(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["item"] for e in events if e["type"] == "response.output_item.done"]


def test_the_websocket_attempt_gets_426(codex) -> None:
    client, _ = codex
    with (
        pytest.raises(WebSocketDenialResponse) as denied,
        client.websocket_connect("/v1/responses"),
    ):
        pass
    assert denied.value.status_code == 426


def test_lite_dialect_text_reply_to_the_end(codex, tok) -> None:
    client, backend = codex
    events = _events(client.post("/v1/responses", json=LITE))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert events[-1]["response"]["id"] and events[-1]["response"]["model"] == "gpt-6.2-sol"
    (message,) = _done_items(events)
    assert message["content"][0]["text"] == ANSWER
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    for offered in ('"functions.exec"', '"functions.wait"', '"clock.sleep"', "lark grammar"):
        assert offered in prompt, offered
    assert "configuration_update" not in prompt and "say hi" in prompt


@pytest.mark.parametrize(
    ("called", "arguments", "want"),
    [
        (
            "functions.exec",
            {"input": 'text("hello")'},
            {
                "type": "custom_tool_call",
                "name": "exec",
                "namespace": "functions",
                "input": 'text("hello")',
            },
        ),
        (
            "functions.wait",
            {"cell_id": "7"},
            {
                "type": "function_call",
                "name": "wait",
                "namespace": "functions",
                "arguments": '{"cell_id": "7"}',
            },
        ),
    ],
)
def test_lite_dialect_calls_go_back_as_codex_runs_them(codex, called, arguments, want) -> None:
    """A namespaced call: its own name plus `namespace`; the custom tool's call a
    custom_tool_call with its text; then the history Codex sends back renders."""
    client, backend = codex
    backend.script(
        f'<tool_call>\n{{"name": "{called}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    )
    (item,) = _done_items(_events(client.post("/v1/responses", json=LITE)))
    assert {k: item[k] for k in want} == want and item["call_id"].startswith("call_")
    whole = client.post("/v1/responses", json={**LITE, "stream": False}).json()
    assert {k: whole["output"][0][k] for k in want} == want
    kind = want["type"] + "_output"
    echoed = {**item, "internal_chat_message_metadata_passthrough": {"turn_id": "t1"}}
    output = [
        {"type": "input_text", "text": "Script completed"},
        {"type": "input_text", "text": "hello"},
    ]
    history = [
        *LITE["input"],
        echoed,
        {"type": kind, "id": "o1", "call_id": item["call_id"], "output": output},
    ]
    backend.script(ANSWER)
    events = _events(client.post("/v1/responses", json={**LITE, "input": history}))
    assert events[-1]["type"] == "response.completed"


def test_non_lite_dialect_hosted_tools_not_offered(codex, tok) -> None:
    client, backend = codex
    response = client.post("/v1/responses", json=NON_LITE)
    assert response.headers["x-kvmesh-tools-not-offered"] == "web_search"
    assert _events(response)[-1]["type"] == "response.completed"
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert '"exec_command"' in prompt and '"multi_agent_v1.wait_agent"' in prompt
    assert "web_search" not in prompt
    backend.script(
        '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
    )
    (call,) = _done_items(_events(client.post("/v1/responses", json=NON_LITE)))
    assert call["type"] == "function_call" and "namespace" not in call
    assert (call["name"], json.loads(call["arguments"])) == ("exec_command", {"cmd": "ls"})


def test_an_error_mid_stream_fails_the_response(codex) -> None:
    """Codex ignores a bare `error` event (and retries): `response.failed` follows it."""
    client, backend = codex
    backend.fail_after_chunks = 2
    kinds = [e["type"] for e in _events(client.post("/v1/responses", json=LITE))]
    assert kinds[-2:] == ["error", "response.failed"]
