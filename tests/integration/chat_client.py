"""The openai client against a running mesh, shared by the mesh tests."""

from __future__ import annotations

import openai


def client_for(mesh) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="x", max_retries=0, timeout=120
    )


def chat_text(client: openai.OpenAI, stream: bool, **kwargs) -> str:
    """The answer's text, from one response or from the streamed deltas."""
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def ask_or_error(
    client: openai.OpenAI,
    messages,
    stream: bool,
    model: str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
) -> tuple[str, str | None]:
    """(text received, error code or None): greedy, streamed or not."""
    text = ""
    kwargs = dict(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_headers=headers,
    )
    try:
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content, None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text, None
    except openai.APIError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        error = body.get("error", body)
        return text, error.get("code") or getattr(exc, "code", None)
