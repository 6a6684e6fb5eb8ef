"""The structured-output suite (tests/data/agent_schemas.json): each case as an OpenAI chat
body, the single-process engine's answers to the very same requests (prompt and grammar built
by the gateway's own parser), and the checks every answer must pass."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from kvmesh.agent.tool_parsers import parse_output
from services.gateway.openai_protocol import parse_request
from services.gateway.served import ServedModel

DATA = Path(__file__).parent.parent / "data" / "agent_schemas.json"
MODEL = "smollm2-135m"
MAX_TOKENS = 160


def cases() -> list[dict[str, Any]]:
    return json.loads(DATA.read_text())["cases"]


def body(case: dict[str, Any], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """The chat request of one case: greedy, with its response format or its tools."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": case["prompt"]}],
    }
    if "system" in case:
        fields["messages"].insert(0, {"role": "system", "content": case["system"]})
    if "schema" in case:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
        }
    else:
        fields["tools"], fields["tool_choice"] = case["tools"], case["tool_choice"]
        fields["parallel_tool_calls"] = case.get("parallel_tool_calls", True)
    return fields


@dataclass(frozen=True)
class Answer:
    """What a reply says: content, calls [(name, arguments JSON text)], finish reason."""

    content: str
    calls: tuple[tuple[str, str], ...]
    finish: str


@functools.cache
def suite_reference(llm: Any) -> tuple[Answer, ...]:
    """The engine's answers to the whole suite (computed once per engine)."""
    llm.engine.block_manager.reset_prefix_cache()
    return tuple(engine_answers(llm, [body(case) for case in cases()]))


def engine_answers(llm: Any, bodies: list[dict[str, Any]]) -> list[Answer]:
    """The engine's answers, all requests batched as the mesh would see them at once."""
    served = ServedModel(MODEL, llm.engine.max_model_len)
    parsed = [parse_request("chat", b, llm.tokenizer, served) for b in bodies]
    outputs = llm.generate_ids(
        [list(p.prompt_token_ids) for p in parsed], [p.params for p in parsed]
    )
    answers = []
    for request, out in zip(parsed, outputs, strict=True):
        # as the gateway shows a reply read for calls: special tokens kept, EOS never
        ids = [t for t in out.token_ids if t not in llm.tokenizer.eos_token_ids]
        text = llm.tokenizer.decode(ids, skip_special_tokens=request.tools is None)
        if request.tools is None:
            answers.append(Answer(text, (), out.finish_reason))
            continue
        reply = parse_output(request.tools.parser_object(), text)
        calls = tuple((c.name, c.arguments) for c in reply.tool_calls)
        finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        answers.append(Answer(reply.content, calls, finish))
    return answers


def mesh_answers(client: Any, bodies: list[dict[str, Any]], in_flight: int = 4) -> list[Answer]:
    """The mesh's answers through the openai client, `in_flight` requests at a time: with k
    drafts each is 1 + k rows a step, to be kept within the 32 rows up to which a row's linear
    kernel does not change with the batch on CPUs without AMX (runner.py)."""

    def ask(fields: dict[str, Any]) -> Answer:
        choice = client.chat.completions.create(**fields).choices[0]
        calls = tuple(
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
        )
        return Answer(choice.message.content or "", calls, choice.finish_reason)

    with ThreadPoolExecutor(in_flight) as pool:
        return list(pool.map(ask, bodies))


def check(case: dict[str, Any], answer: Answer) -> None:
    """A finished answer is valid JSON for the schema / calls valid for their tools; a cut one
    says `length`."""
    assert answer.finish in ("stop", "tool_calls", "length"), (case["name"], answer)
    if answer.finish == "length":
        return
    if "schema" in case:
        jsonschema.validate(json.loads(answer.content), case["schema"])
        return
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
    choice = case["tool_choice"]
    if choice != "auto":
        assert answer.calls and answer.finish == "tool_calls", (case["name"], answer)
    for name, arguments in answer.calls:
        jsonschema.validate(json.loads(arguments), tools[name])


# Three earlier turns of the currency case, each a call, its result and an answer: after them
# the model opens its reply with a call of its own under tool_choice auto (SmolLM2 answers the
# bare prompt with prose), so the lazy trigger of a strict tool is crossed for real.
_EARLIER = [
    ("Convert 20 USD to GBP.", 20, "USD", "GBP", "16.0"),
    ("Convert 75 JPY to EUR.", 75, "JPY", "EUR", "0.46"),
    ("Convert 9 CHF to USD.", 9, "CHF", "USD", "10.2"),
]


def called_history(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The currency case's messages after three turns that called its tool (OpenAI chat)."""
    name = case["tools"][0]["function"]["name"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": case["system"]}]
    for i, (question, amount, source, target, result) in enumerate(_EARLIER):
        arguments = json.dumps({"amount": amount, "from": source, "to": target})
        messages += [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
            {"role": "assistant", "content": f"{amount} {source} is {result} {target}."},
        ]
    return [*messages, {"role": "user", "content": case["prompt"]}]
