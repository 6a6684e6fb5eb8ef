"""The openai client against a running mesh, shared by the mesh tests."""

from __future__ import annotations

import openai


def client_for(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="x",
                         max_retries=0, timeout=120)  # fmt: skip


def chat_text(client: openai.OpenAI, stream: bool, **kwargs) -> str:
    """The answer's text, from one response or from the streamed deltas."""
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
