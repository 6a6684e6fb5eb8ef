"""What the tool-calling tests share: the tools, the question, the calls the scripted backend makes."""

from __future__ import annotations

from typing import Any

import openai

MODEL = "smollm2-135m"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]


ARGS = '{"city": "Paris", "units": {"t": "C"}}'


TWO_CALLS = (
    "Let me look that up.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, **fields})
