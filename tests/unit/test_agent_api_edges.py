"""Edges of the agent APIs on the gateway (scripted backend, official clients): the tool-call
parser flag, a template that renders tools itself, Anthropic's disable_parallel_tool_use as the
same grammar as OpenAI's parallel_tool_calls false, the Responses developer role, errors in band
once an Anthropic or Responses stream has begun, `suffix` refused."""

from __future__ import annotations

import copy
import json

import anthropic
import openai
import pytest

from services.gateway.openai_api import create_app
from tests.unit.fake_backend import FakeBackend, serve_app

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": CITY}}
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def _served(tok, **app):
    backend = FakeBackend(tok, tokens_per_chunk=1)
    return backend, serve_app(create_app(backend, tok, **app))


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def test_the_tool_call_parser_flag_overrides_the_templates_choice(tok) -> None:
    """SmolLM2's template picks hermes, where a bare JSON object is text; with the flag set to
    llama3_json the same reply is a call."""
    for parser, calls in ((None, 0), ("llama3_json", 1)):
        backend, serving = _served(tok, tool_parser=parser)
        backend.script(LLAMA3_CALL)
        with serving as url:
            message = (
                _openai(url)
                .chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
                .choices[0]
                .message
            )
        assert len(message.tool_calls or []) == calls, (parser, message)
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_a_template_that_knows_tools_renders_them_itself(tok) -> None:
    """A chat template reading `tools` gets them (and the calls and results in the history) in
    transformers' shape; the built-in hermes preamble is not added."""
    own = copy.copy(tok)
    own.hf = copy.copy(tok.hf)
    own.hf.chat_template = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}{% endfor %}"
        "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}<assistant>"
    )
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
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    backend, serving = _served(own)
    with serving as url:
        _openai(url).chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    prompt = own.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    assert 'CALL get_weather {"city": "Paris"}' in prompt and "<tool>18 C FOR call_1" in prompt
    assert "<tools>" not in prompt  # no built-in preamble


def test_disable_parallel_tool_use_is_parallel_tool_calls_false(tok) -> None:
    """Anthropic's tool_choice any (+ disable_parallel_tool_use) and OpenAI's required (+
    parallel_tool_calls false) are one grammar each way: at most one call when disabled."""
    backend, serving = _served(tok)
    tools = [{"name": t["function"]["name"], "input_schema": CITY} for t in (WEATHER, TIME)]
    grammars = {}
    with serving as url:
        claude = anthropic.Anthropic(
            base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0
        )
        for off in (False, True):
            claude.messages.create(
                model=MODEL,
                max_tokens=64,
                messages=ASK,
                tools=tools,
                tool_choice={"type": "any", "disable_parallel_tool_use": off},
            )
            grammars["anthropic", off] = backend.requests[-1].params.grammar
            _openai(url).chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=[WEATHER, TIME],
                tool_choice="required",
                parallel_tool_calls=not off,
            )
            grammars["openai", off] = backend.requests[-1].params.grammar
    assert grammars["anthropic", True] == grammars["openai", True]
    assert grammars["anthropic", False] == grammars["openai", False]
    assert grammars["anthropic", True] != grammars["anthropic", False]


def test_the_responses_developer_role_reaches_the_prompt(tok) -> None:
    backend, serving = _served(tok)
    with serving as url:
        _openai(url).responses.create(
            model=MODEL, input=[{"role": "developer", "content": "Answer in French."}, *ASK]
        )
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.index("Answer in French.") < prompt.index("Weather in Paris?")


def test_a_failure_after_the_stream_began_is_an_error_event(tok) -> None:
    """Anthropic: an `error` event in Anthropic's shape; Responses: an `error` event, then
    `response.failed` (Codex ignores a bare `error` event); neither a hang nor a cut the
    client cannot tell from the end."""
    backend, serving = _served(tok)
    backend.fail_after_chunks = 3
    with serving as url:
        claude = anthropic.Anthropic(
            base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0
        )
        failing = claude.messages.stream(model=MODEL, max_tokens=64, messages=ASK)
        with pytest.raises(anthropic.APIStatusError, match="decode worker went away"), failing as s:
            list(s)
        events = list(_openai(url).responses.create(model=MODEL, input="Hi", stream=True))
    assert events[0].type == "response.created"
    assert events[-2].type == "error" and "decode worker went away" in events[-2].message
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert "decode worker went away" in events[-1].response.error.message


def test_suffix_is_refused_by_name(tok) -> None:
    _, serving = _served(tok)
    with serving as url, pytest.raises(openai.BadRequestError, match="suffix"):
        _openai(url).completions.create(model=MODEL, prompt="def f(", suffix="return 1")


class _LoggingBackend(FakeBackend):
    """Logs when each request starts and yields, to see the order of a request's choices."""

    def __init__(self, tok) -> None:
        super().__init__(tok, tokens_per_chunk=1)
        self.log: list[tuple[str, str]] = []

    async def generate(self, request):
        self.log.append(("start", request.request_id))
        async for chunk in super().generate(request):
            self.log.append(("chunk", request.request_id))
            yield chunk


@pytest.mark.parametrize("stream", [False, True])
def test_later_choices_start_once_the_first_has_a_token(tok, stream) -> None:
    """n = 3: choices 1 and 2 are sent once choice 0 has its first token (its prompt's pages
    then in the prefix cache for them), all three replies whole."""
    backend = _LoggingBackend(tok)
    with serve_app(create_app(backend, tok)) as url:
        reply = _openai(url).chat.completions.create(model=MODEL, messages=ASK, n=3, stream=stream)
        if stream:
            list(reply)
    first = backend.requests[0].request_id
    starts = [i for i, (kind, _) in enumerate(backend.log) if kind == "start"]
    assert len(starts) == 3 and backend.log[0] == ("start", first)
    assert backend.log.index(("chunk", first)) < starts[1] < starts[2], backend.log[:6]
