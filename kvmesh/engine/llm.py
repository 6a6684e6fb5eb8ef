"""`kvmesh.LLM`: the offline Python API over the engine, with detokenization and stop strings."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from kvmesh.config import EngineConfig
from kvmesh.engine.core.engine import Engine, TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.loader import DEFAULT_MODEL
from kvmesh.engine.runner.sampler import TokenLogprob
from kvmesh.engine.spec.proposer import DraftSource
from kvmesh.errors import InvalidRequestError

Prompt = str | list[int]
Messages = list[dict[str, Any]]


@dataclass
class CompletionOutput:
    """One finished request, as vLLM's RequestOutput flattened to its single completion."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # "<code>: <message>" when the engine aborted the request
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.total_s - self.ttft_s
        return (
            (len(self.token_ids) - 1) / decode_time
            if decode_time > 0 and len(self.token_ids) > 1
            else 0.0
        )


class LLM:
    """`LLM(model=...).generate(prompts, SamplingParams())` and `.chat(messages, ...)`."""

    def __init__(
        self, model: str = DEFAULT_MODEL, draft: DraftSource | None = None, **engine_options: Any
    ) -> None:
        """`engine_options`: the config tree's knobs by name (kvmesh/config); `draft`: see Engine."""
        self.engine = Engine(EngineConfig.of(model=model, **engine_options), draft)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None
    ) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        return self.generate_ids(token_lists, params or SamplingParams())

    def chat(
        self, messages: Messages | Seq[Messages], params: SamplingParams | None = None
    ) -> list[CompletionOutput]:
        if not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        token_lists = [self.tokenizer.encode_chat(c) for c in conversations]
        return self.generate_ids(token_lists, params or SamplingParams())

    def generate_ids(
        self, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[CompletionOutput]:
        """Run every prompt to completion with continuous batching (one SamplingParams for all,
        or one per prompt); outputs in prompt order."""
        start = time.perf_counter()
        outputs: dict[str, CompletionOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(each) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(each)} SamplingParams")
        try:
            for prompt, one in zip(prompts, each, strict=True):
                rid = f"req-{next(self._ids)}"
                self.engine.add_request(rid, prompt, one)
                outputs[rid] = CompletionOutput(
                    rid, list(prompt), logprobs=[] if one.logprobs is not None else None
                )
                detoks[rid] = IncrementalDetokenizer(
                    self.tokenizer,
                    one.stop,
                    one.include_stop_str_in_output,
                    one.skip_special_tokens,
                    prompt,
                )
            while self.engine.has_unfinished():
                for step in self.engine.step():
                    self._absorb(outputs[step.request_id], detoks[step.request_id], step, start)
        except BaseException:
            for rid in outputs:
                self.engine.abort(rid)
            raise
        return list(outputs.values())

    def _absorb(
        self, out: CompletionOutput, detok: IncrementalDetokenizer, step: TokenOutput, start: float
    ) -> None:
        now = time.perf_counter() - start
        if not out.token_ids:
            out.ttft_s = now
        out.token_ids.extend(step.new_token_ids)
        if out.logprobs is not None:
            out.logprobs.extend(lp for lp in step.new_logprobs if lp is not None)
        out.num_cached_tokens = step.num_cached_tokens
        if step.error is not None:
            out.error = f"{step.error.code}: {step.error}"
        result = detok.push(step.new_token_ids, final=step.finished)
        out.text += result.delta
        if result.stopped_on is not None and not step.finished:
            self.engine.finish(step.request_id, FinishReason.STOP)
            out.text += detok.push([], final=True).delta
            out.finish_reason, out.total_s = FinishReason.STOP.value, now
        elif step.finished:
            out.finish_reason, out.total_s = step.finish_reason.value, now  # type: ignore[union-attr]
