"""Turns a plain-data step (step.py) into tensors, runs the model and returns the logits of the
rows to sample. The runner keeps its own copy of each request's tokens, pages and expected page
tags (the pages and tags in numpy rows that persist across steps: block_tables.py), updated from
the step's new requests and diffs; it never sees the scheduler's `Sequence` objects."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.engine.attention import AttentionBackend, BatchLayout
from kvmesh.engine.core.step import ChunkPlan, StepPlan
from kvmesh.engine.models import CausalLM
from kvmesh.engine.pool.block_tables import BlockTables
from kvmesh.engine.pool.kv_cache import PagedKVCache
from kvmesh.engine.runner.decode_steps import decode_steps
from kvmesh.engine.runner.host_tensors import int_tensor
from kvmesh.engine.runner.warm_up import padding_layout


@dataclass(frozen=True)
class StepResult:
    """Logits of the chunks that sample this step, in `req_ids` order: one row per chunk, or
    1 + k rows for a chunk verifying k drafts (`rows[i]` rows for req_ids[i]). In the LM head's
    dtype (bf16 with bf16 weights): greedy argmax reads them as they are, and whoever needs
    fp32 converts only the rows it uses (a fresh [64, V] fp32 copy each step cost page faults:
    docs/benchmarks-history.md, "A Xeon without AMX: bf16 linears in register tiles, attention
    in registers, host work, prefill threads")."""

    logits: torch.Tensor
    req_ids: list[str]
    rows: list[int]


@dataclass(frozen=True)
class RunnerOptions:
    """How the runner runs its passes, fixed when it is built."""

    decode_step: str = "eager"  # --decode-step: eager | fused | compiled | graphs (config/)
    max_rows: int = 1  # compiled: the largest decode batch graphed (--max-num-seqs)
    max_model_len: int = 0  # compiled: the widest block table
    micro_batches: int = 1  # pipeline stages: a step's rows in this many groups (overlap)
    capture: tuple[int, ...] = ()  # layers whose outputs each step keeps (EAGLE's features)
    record: Any = None  # graphs: how a step is recorded (the platform's graph_recorder)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        attention: AttentionBackend,
        options: RunnerOptions = RunnerOptions(),
    ) -> None:
        self.model = model
        self.kv = kv
        self.attention = attention
        self.page_size = kv.spec.page_size
        self.tokens: dict[str, list[int]] = {}  # req_id -> its token ids so far
        self.tables = BlockTables(kv.null_page)  # req_id -> its pages and their expected tags
        self.capture = options.capture
        self.features: torch.Tensor | None = None  # [T, len(capture) * H], rows in step order
        self.rows_of: dict[str, tuple[int, int]] = {}  # req_id -> its rows [begin, end) last step
        self.micro_batches = options.micro_batches
        # decode (and verify) steps as one op (fused_decode.py), or decode-only steps' graphs
        # (compiled.py), each where the model fits it
        self.fused, self.compiled = decode_steps(options, model, kv, attention)
        if self.compiled is not None:
            self.compiled.start(self.run_padding)

    @contextlib.contextmanager
    def using(
        self,
        fused: bool = True,
        compiled: bool = True,
        capture: tuple[int, ...] | None = None,
    ) -> Iterator[None]:
        """For a while: without the fused or compiled step it has (a benchmark compares them
        on one engine), or keeping other layers' outputs (EAGLE training reads a target's)."""
        kept = self.fused, self.compiled, self.capture
        self.fused = self.fused if fused else None
        self.compiled = self.compiled if compiled else None
        self.capture = self.capture if capture is None else capture
        try:
            yield
        finally:
            self.fused, self.compiled, self.capture = kept

    def apply(self, plan: StepPlan) -> None:
        """Bring the per-request state up to date (finished first: an id may come back new)."""
        tokens, tables = self.tokens, self.tables
        for req_id in plan.finished:
            self._forget(req_id)
        for new in plan.new:
            tokens[new.req_id] = list(new.token_ids)
            tables.add(new.req_id, new.block_table, new.page_tags)
        for diff in plan.diffs:
            tokens[diff.req_id] += diff.new_token_ids
            tables.update(diff.req_id, diff.num_blocks_kept, diff.new_block_ids, diff.new_page_tags)

    def _forget(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)
        self.tables.remove(req_id)

    def run(self, plan: StepPlan) -> StepResult:
        self.apply(plan)
        return self.execute(plan.chunks)

    def execute(self, chunks: tuple[ChunkPlan, ...]) -> StepResult:
        """Run chunks of requests already brought up to date by `apply`: in micro-batches
        under pipeline stages (each group's rows go on to the next stage while this one runs
        the next group), their logits taken once every group ran."""
        if self.micro_batches > 1 and len(chunks) > 1:
            passes = [self._forward(group) for group in micro_batches(chunks, self.micro_batches)]
        else:
            passes = [self._forward(chunks)]
        logits, req_ids, counts = [], [], []
        for hidden, sample_rows, ids, rows in passes:
            if not sample_rows:  # (a prompt's chunk before its last): no LM head on any rank
                logits.append(hidden.new_empty((0, self.model.config.vocab_size)))
                continue
            if len(sample_rows) != hidden.shape[0]:  # else every row samples, in order
                hidden = hidden[int_tensor(sample_rows)]
            logits.append(self.model.logits(hidden))
            req_ids += ids
            counts += rows
        return StepResult(logits[0] if len(logits) == 1 else torch.cat(logits), req_ids, counts)

    def score_rows(self, plan: StepPlan) -> list[torch.Tensor]:
        """Logits [width, V] of every row of each chunk, in `plan.chunks` order (teacher
        forcing: perplexity, tests against a reference)."""
        self.apply(plan)
        hidden, _, _, _ = self._forward(plan.chunks)
        logits = self.model.logits(hidden).float()
        return [logits[slice(*self.rows_of[c.req_id])] for c in plan.chunks]

    def score(self, plan: StepPlan) -> torch.Tensor:
        """`score_rows` of a one-request step whose request is forgotten afterwards."""
        try:
            return torch.cat(self.score_rows(plan))
        finally:
            for chunk in plan.chunks:
                self._forget(chunk.req_id)

    def _forward(self, chunks: tuple[ChunkPlan, ...]):
        """Hidden states of every row, the rows to sample, their request ids and row counts:
        decode rows first, then prefill chunks (and verify chunks) in order."""
        if all(c.is_decode for c in chunks):
            return self._forward_decode(chunks)
        ordered = [c for c in chunks if c.is_decode] + [c for c in chunks if not c.is_decode]
        num_decode = sum(c.is_decode for c in chunks)
        ids = [t for c in ordered for t in _chunk_tokens(c, self.tokens[c.req_id])]
        starts = [c.start for c in ordered]
        widths = [c.width for c in ordered]
        tables = [self.tables.table(c.req_id) for c in ordered]
        sample_rows, req_ids, counts, row = [], [], [], 0
        self.rows_of = {}
        for chunk in ordered:
            self.rows_of[chunk.req_id] = (row, row + chunk.width)
            if chunk.sample:
                sample_rows.extend(range(row + chunk.num_tokens - 1, row + chunk.width))
                req_ids.append(chunk.req_id)
                counts.append(1 + len(chunk.draft))
            row += chunk.width
        if self.fused is not None and all(c.num_tokens == 1 for c in ordered):
            starts, widths, tables = _verify_rows_as_decode_rows(ordered, starts, tables)
            num_decode = len(ids)
        hidden = self._run_model(ids, starts, widths, tables, num_decode, None)
        return hidden, sample_rows, req_ids, counts

    def _forward_decode(self, chunks: tuple[ChunkPlan, ...]):
        """`_forward` of a step of decode rows only (most steps), in fewer passes over them."""
        tokens = self.tokens
        req_ids = [c.req_id for c in chunks]
        starts = [c.start for c in chunks]
        ids = [tokens[r][start] for r, start in zip(req_ids, starts, strict=True)]
        rows = len(chunks)
        self.rows_of = {req_id: (i, i + 1) for i, req_id in enumerate(req_ids)}
        bucket = self.compiled.bucket(rows) if self.compiled is not None else None
        tables = self._decode_tables(req_ids, starts, bucket)
        sampling = [i for i, c in enumerate(chunks) if c.sample]
        if len(sampling) < rows:  # a finalizing request computes its last KV without sampling
            req_ids = [req_ids[i] for i in sampling]
        if bucket is not None:  # padding rows up to the bucket, their KV into the scratch page
            extra = bucket - rows
            ids += [0] * extra
            starts += [0] * extra
        total = bucket or rows
        hidden = self._run_model(ids, starts, [1] * total, tables, total, bucket)
        return hidden, sampling, req_ids, [1] * len(sampling)

    def _decode_tables(
        self, req_ids: list[str], starts: list[int], bucket: int | None
    ) -> np.ndarray:
        """The decode rows' block tables as one null-padded [rows, W] array, gathered from the
        persistent tables; W covers each row's pages and the compiled step's width; padding
        rows of a bucket hold the scratch page."""
        size = self.page_size
        width = -(-(max(starts) + 1) // size)
        if bucket is not None:
            width = max(width, self.compiled.max_pages)
        tables = self.tables.gather(self.tables.rows(req_ids), width)
        if bucket is not None and bucket > len(req_ids):
            pad = np.full((bucket - len(req_ids), width), self.kv.null_page, dtype=np.int32)
            pad[:, 0] = self.kv.scratch_page
            tables = np.concatenate([tables, pad])
        return tables

    def _run_model(self, ids, starts, widths, tables, num_decode, bucket):
        """The model over these rows; through the compiled graph of `bucket` if not None."""
        if len(starts) == len(ids):  # one token per row: its position is its start
            positions = int_tensor(starts)
        else:
            positions = int_tensor(
                p for s, w in zip(starts, widths, strict=True) for p in range(s, s + w)
            )
        width = self.compiled.max_pages if bucket is not None else 0
        if not isinstance(tables, np.ndarray):
            tables = tuple(tables)
        layout = BatchLayout(
            num_decode,
            tables,
            tuple(starts),
            tuple(widths),
            self.page_size,
            self.kv.null_page,
            width,
        )
        meta = self.attention.build_metadata(layout)
        ids, device = int_tensor(ids), self.kv.pool.device
        if device.type != "cpu":  # a GPU's rows: the step's one copy of them (the tables: meta)
            ids, positions = (
                ids.to(device, non_blocking=True),
                positions.to(device, non_blocking=True),
            )
        args = (ids, positions, meta, self.kv.layers, self.attention, self.capture)
        out = None
        if bucket is not None:
            out = self.compiled.try_forward(*args)
        elif self.fused is not None and num_decode == len(widths) == len(ids):
            out = self.fused.forward(args[0], positions, meta, self.capture)
        if out is None:
            out = self.model.forward(*args)
        hidden, self.features = out
        return hidden

    def run_padding(self, bucket: int, forward) -> None:
        """One step of `bucket` padding rows only (their KV into the scratch page) through
        `forward`: how the compiled step is warmed up without touching any request's pages."""
        layout = padding_layout(self.kv, bucket, self.compiled.max_pages)
        meta = self.attention.build_metadata(layout)
        ids, positions = (
            torch.zeros(bucket, dtype=torch.long),
            torch.zeros(bucket, dtype=torch.long),
        )
        forward(ids, positions, meta, self.kv.layers, self.attention, self.capture)


def micro_batches(chunks: tuple[ChunkPlan, ...], count: int) -> list[tuple[ChunkPlan, ...]]:
    """The chunks in at most `count` consecutive groups of about equal rows (a chunk whole):
    every rank of a pipeline splits a pass alike."""
    total, groups, rows = sum(c.width for c in chunks), [[]], 0
    for chunk in chunks:
        if groups[-1] and len(groups) < count and rows >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(chunk)
        rows += chunk.width
    return [tuple(group) for group in groups]


def _verify_rows_as_decode_rows(ordered, starts, tables):
    """A chunk verifying k drafts as k + 1 decode rows of its own (the fused step's), row i
    attending over the context up to its own token: causal attention through the paged kernel,
    so a verified row gets the bits of the same token decoded alone wherever the linears' kernel
    is the same at both row counts (always on AVX2; up to 32 rows without AMX; 4 with it)."""
    rows = [
        (s + i, t) for c, s, t in zip(ordered, starts, tables, strict=True) for i in range(c.width)
    ]
    return [r[0] for r in rows], [1] * len(rows), [r[1] for r in rows]


def _chunk_tokens(chunk: ChunkPlan, tokens: list[int]) -> list[int]:
    return tokens[chunk.start : chunk.start + chunk.num_tokens] + list(chunk.draft)
