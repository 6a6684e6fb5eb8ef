"""Drives an engine's model runner directly with plain-data steps (step.py), so a test can read
every row's logits: a batch of prompts in one step, then decode steps, against transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from kvmesh.engine.core.step import ChunkPlan, NewRequest, RequestDiff, StepPlan

PAGES_PER_REQUEST = 8


def reference_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@torch.no_grad()
def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


class RunnerDriver:
    """Requests r = 0, 1, ... own pages [r * 8, r * 8 + 8) of the engine's pool."""

    def __init__(self, engine) -> None:
        self.runner = engine.runner
        self.tokens: dict[str, list[int]] = {}

    def _table(self, index: int) -> tuple[int, ...]:
        return tuple(range(index * PAGES_PER_REQUEST, (index + 1) * PAGES_PER_REQUEST))

    def prefill(self, prompts: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
        """Every prompt in one step (or in chunks of `chunk` tokens): logits of every row."""
        new = []
        for i, prompt in enumerate(prompts):
            self.tokens[f"r{i}"] = list(prompt)
            new.append(NewRequest(f"r{i}", tuple(prompt), self._table(i), (0,) * PAGES_PER_REQUEST))
        out = [[] for _ in prompts]
        start, first = 0, True
        while any(start < len(p) for p in prompts):
            chunks = []
            for i, p in enumerate(prompts):
                if start < len(p):
                    n = min(chunk or len(p), len(p) - start)
                    chunks.append(ChunkPlan(f"r{i}", start, n, start + n == len(p)))
            plan = StepPlan(tuple(new) if first else (), (), tuple(chunks), ())
            rows = self.runner.score_rows(plan)
            for c, logits in zip(chunks, rows, strict=True):
                out[int(c.req_id[1:])].append(logits)
            start += chunk or max(len(p) for p in prompts)
            first = False
        return [torch.cat(parts) for parts in out]

    def decode(self, next_tokens: dict[str, int]) -> dict[str, torch.Tensor]:
        """One decode step appending `next_tokens`: each request's logits row."""
        diffs, chunks = [], []
        for req_id, token in next_tokens.items():
            self.tokens[req_id].append(token)
            diffs.append(RequestDiff(req_id, (token,), PAGES_PER_REQUEST, (), ()))
            chunks.append(ChunkPlan(req_id, len(self.tokens[req_id]) - 1, 1, True))
        result = self.runner.run(StepPlan((), tuple(diffs), tuple(chunks), ()))
        return dict(zip(result.req_ids, result.logits, strict=True))
