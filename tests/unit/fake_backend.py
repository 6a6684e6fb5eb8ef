"""A scripted GenerateBackend on the real tokenizer: gateway tests without an engine or a GPU."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import uvicorn

from kvmesh.engine.core.outputs import TokenLogprob
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.mesh.error_mapping import WorkerUnavailableError
from services.gateway.backend import GenerateChunk, GenerateInput

ANSWER = "The capital of France is Paris. It is famous for the Eiffel Tower and its café culture."
CACHE_PAGE = 16  # the fake reports whole pages of the prompt as cached


def cached_tokens_for(prompt_len: int) -> int:
    return prompt_len // CACHE_PAGE * CACHE_PAGE


class FakeBackend:
    """Replies ANSWER then EOS, `tokens_per_chunk` tokens at a time, cut at max_tokens.

    Scriptable failures: raise `failure` before chunk `fail_after_chunks`, or wait until
    cancelled before chunk `hang_after_chunks`. Records every request, abort and cancellation.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str = "smollm2-135m",
        max_model_len: int = 2048,
        tokens_per_chunk: int = 2,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self.answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.eos_id = min(tokenizer.eos_token_ids)
        self.vocab_size = tokenizer.vocab_size
        self.tokens_per_chunk = tokens_per_chunk
        self.requests: list[GenerateInput] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.fail_after_chunks: int | None = None
        self.failure: Exception = WorkerUnavailableError("decode worker went away")
        self.hang_after_chunks: int | None = None

    def script(self, answer: str) -> None:
        """Reply `answer` (then EOS) from now on."""
        self.answer_ids = self._tokenizer.encode(answer, add_special_tokens=False)

    def reply_ids(self, params: SamplingParams) -> list[int]:
        """The tokens this backend generates for `params` (EOS included when it fits)."""
        script = self.answer_ids * (params.max_tokens // len(self.answer_ids) + 1)
        full = script if params.ignore_eos else [*self.answer_ids, self.eos_id]
        return full[: params.max_tokens]

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        ids = self.reply_ids(request.params)
        step = self.tokens_per_chunk
        for index, start in enumerate(range(0, len(ids), step)):
            await self._script(request.request_id, index)
            if request.request_id in self.aborted:
                yield GenerateChunk(finish_reason="abort")
                return
            token_ids = ids[start : start + step]
            last = start + step >= len(ids)
            yield self._chunk(request, token_ids, last, ids)

    async def _script(self, request_id: str, index: int) -> None:
        if index == self.hang_after_chunks:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(request_id)
                raise
        if index == self.fail_after_chunks:
            raise self.failure
        await asyncio.sleep(0)

    def _chunk(
        self, request: GenerateInput, token_ids: list[int], last: bool, ids: list[int]
    ) -> GenerateChunk:
        finish = None
        if last:
            finish = (
                "stop" if ids[-1] == self.eos_id and not request.params.ignore_eos else "length"
            )
        prompt_len = len(request.prompt_token_ids)
        return GenerateChunk(
            token_ids=token_ids,
            logprobs=[self._logprob(t, request.params.logprobs) for t in token_ids],
            finish_reason=finish,
            prompt_tokens=prompt_len if last else 0,
            cached_tokens=cached_tokens_for(prompt_len) if last else 0,
        )

    def _logprob(self, token_id: int, top_n: int | None) -> TokenLogprob | None:
        if top_n is None:
            return None
        others = [((token_id + j) % self.vocab_size, -1.0 - j) for j in range(1, top_n)]
        top = ((token_id, -0.25), *others)[:top_n]
        return TokenLogprob(token_id=token_id, logprob=-0.25, rank=1, top=top)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@contextmanager
def serve_app(app) -> Iterator[str]:
    """The ASGI app on a real uvicorn server on a free loopback port: its /v1 base URL."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
