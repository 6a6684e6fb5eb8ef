"""The `n` choices of one OpenAI request: one generation each (choice i under request id
`<id>-i` for i > 0, and seed + i when seeded, so the choices differ and replay), whole or as
one merged stream, and the stream events of each choice's deltas. Choices after the first
start once the first has its first token: its prompt's pages are then in the prefix cache,
where the others' prefills find them (computed once, as a fork after prefill would share
them), instead of n prefills of the same prompt at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace

from services.gateway import openai_responses as resp
from services.gateway.generation import Delta, Generation
from services.gateway.openai_protocol import ParsedRequest
from services.gateway.openai_responses import LogprobFormatter, ResponseMeta, Usage
from services.gateway.tool_output import ToolReply
from services.gateway.tool_output import finish_reason as finish_reason_of


@dataclass
class Choice:
    index: int
    generation: Generation
    formatter: LogprobFormatter
    tools: ToolReply | None


def choice_requests(parsed: ParsedRequest, request_id: str) -> list[tuple[str, ParsedRequest]]:
    """(request id, request) of each choice."""
    out = []
    for i in range(parsed.n):
        params = parsed.params
        if i and params.seed is not None:
            params = replace(params, seed=params.seed + i)
        out.append((request_id if i == 0 else f"{request_id}-{i}", replace(parsed, params=params)))
    return out


def total_usage(choices: list[Choice]) -> Usage:
    """The prompt once, the completions of every choice."""
    usages = [c.generation.usage for c in choices]
    return Usage(
        usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), usages[0].cached_tokens
    )


async def merged(streams: list[AsyncGenerator[Delta, None]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream as they come, streams after the first begun once
    it has given a delta (or ended); the first error ends them all."""
    if len(streams) == 1:  # no tasks for the usual case
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    first_out = asyncio.Event()  # the first stream's prompt is prefilled (or it ended)

    async def pump(index: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            if index:
                await first_out.wait()
            async for delta in stream:
                await queue.put((index, delta, None))
                first_out.set()
            await queue.put((index, None, None))
        except Exception as exc:
            await queue.put((index, None, exc))
        finally:
            first_out.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                running -= 1
                continue
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def delta_events(
    meta: ResponseMeta, delta: Delta, choice: Choice, texts: resp.TextChunks
) -> list[bytes]:
    """The stream events of a choice's delta: its text (or tool-call parts, with logprobs where
    asked), then its finish."""
    finish = delta.finish_reason
    if not delta.logprobs and choice.tools is None:  # plain text: the usual token
        events = [texts.event(delta.text)] if delta.text else []
    else:
        events = [resp.sse_event(body) for body in _delta_bodies(meta, delta, choice)]
        if choice.tools is not None:
            finish = finish_reason_of(finish, choice.tools.called)
    if finish is not None:
        events.append(resp.sse_event(resp.chunk_body(meta, None, finish, index=choice.index)))
    return events


def _delta_bodies(meta: ResponseMeta, delta: Delta, choice: Choice) -> list[dict]:
    """The chunks of a delta with logprobs or read for tool calls (its finish aside)."""
    logprobs = choice.formatter.format(delta.logprobs) if delta.logprobs else None
    tools, index = choice.tools, choice.index
    if tools is None:
        if not delta.text and logprobs is None:
            return []
        return [resp.chunk_body(meta, delta.text, logprobs=logprobs, index=index)]
    parts = tools.delta_bodies(delta.text, final=delta.finish_reason is not None)
    if logprobs is not None and not parts:
        parts = [{}]  # the tokens' logprobs even where they added no certain text yet
    return [
        resp.chunk_body(meta, None, logprobs=None if i else logprobs, delta=part, index=index)
        for i, part in enumerate(parts)
    ]
