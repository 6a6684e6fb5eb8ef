"""Turns a scheduler step into tensors, runs the model and returns logits of the rows to sample."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvmesh.engine.attention import AttentionBackend, AttentionMetadata, PrefillSpan, Slots
from kvmesh.engine.kv_cache import PagedKVCache
from kvmesh.engine.models.llama import LlamaModel
from kvmesh.engine.scheduler import ScheduledChunk
from kvmesh.engine.sequence import Sequence


@dataclass(frozen=True)
class StepResult:
    """Logits (float32) of the chunks that sample this step, in `seqs` order: one row per
    chunk, or 1 + k rows for a chunk verifying k drafts (`rows[i]` rows for seqs[i])."""

    logits: torch.Tensor
    seqs: list[Sequence]
    rows: list[int]


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: PagedKVCache, attention: AttentionBackend) -> None:
        self.model = model
        self.kv = kv
        self.attention = attention
        self.page_size = kv.spec.page_size
        self._page_offsets = torch.arange(self.page_size)
        self.capture: tuple[int, ...] = ()  # layers whose outputs the last step kept (EAGLE)
        self.features: torch.Tensor | None = None  # [T, len(capture) * H], rows in step order
        self.rows_of: dict[str, tuple[int, int]] = {}  # seq_id -> its rows [begin, end) last step

    def _forward(
        self, chunks: Seq[ScheduledChunk]
    ) -> tuple[torch.Tensor, list[int], list[Sequence], list[int]]:
        decodes = [c for c in chunks if c.num_tokens == 1 and not c.draft]
        prefills = [c for c in chunks if c.num_tokens > 1 or c.draft]
        ids, positions, slots, sample_rows, seqs, counts = [], [], [], [], [], []
        decode_gather = decode_mask = None
        if decodes:
            decode_gather, decode_mask, decode_slots = self._decode_inputs(decodes)
            ids.append(torch.tensor([c.seq.token_ids[c.start] for c in decodes]))
            positions.append(torch.tensor([c.start for c in decodes]))
            slots.append(decode_slots)
        spans, row = [], len(decodes)
        for chunk in prefills:
            span, chunk_slots = self._prefill_inputs(chunk, row)
            spans.append(span)
            ids.append(torch.tensor(_chunk_tokens(chunk)))
            positions.append(torch.arange(chunk.start, span.context_start + span.end - span.begin))
            slots.append(chunk_slots)
            row = span.end
        for i, chunk in enumerate(decodes):
            if chunk.sample:
                sample_rows.append(i)
                seqs.append(chunk.seq)
                counts.append(1)
        for chunk, span in zip(prefills, spans, strict=True):
            if chunk.sample:
                first = span.end - 1 - len(chunk.draft)
                sample_rows.extend(range(first, span.end))
                seqs.append(chunk.seq)
                counts.append(1 + len(chunk.draft))
        self.rows_of = {c.seq.seq_id: (i, i + 1) for i, c in enumerate(decodes)}
        self.rows_of.update(
            (c.seq.seq_id, (s.begin, s.end)) for c, s in zip(prefills, spans, strict=True)
        )
        meta = AttentionMetadata(
            Slots.of(torch.cat(slots), self.page_size),
            len(decodes),
            decode_gather,
            decode_mask,
            tuple(spans),
        )
        hidden, self.features = self.model.forward(
            torch.cat(ids), torch.cat(positions), meta, self.kv.layers, self.attention, self.capture
        )
        return hidden, sample_rows, seqs, counts

    def run(self, chunks: Seq[ScheduledChunk]) -> StepResult:
        hidden, sample_rows, seqs, counts = self._forward(chunks)
        logits = self.model.logits(hidden[torch.tensor(sample_rows, dtype=torch.long)])
        return StepResult(logits, seqs, counts)

    def score(self, chunk: ScheduledChunk) -> torch.Tensor:
        """Logits [n, V] of every token of one chunk (teacher forcing), e.g. for perplexity."""
        hidden, _, _, _ = self._forward([chunk])
        return self.model.logits(hidden)

    def _slots_of(self, block_table: list[int], length: int) -> torch.Tensor:
        pages = torch.tensor(block_table[: (length + self.page_size - 1) // self.page_size])
        return (pages.unsqueeze(1) * self.page_size + self._page_offsets).flatten()[:length]

    def _decode_inputs(self, decodes: list[ScheduledChunk]):
        lengths = torch.tensor([c.start + 1 for c in decodes])
        max_pages = (int(lengths.max()) + self.page_size - 1) // self.page_size
        tables = torch.tensor([_padded(c.seq.block_table, max_pages) for c in decodes])
        gather = (tables.unsqueeze(-1) * self.page_size + self._page_offsets).flatten(1)
        gather = gather[:, : int(lengths.max())]
        mask = torch.arange(gather.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        new_slots = gather.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
        return Slots.of(gather, self.page_size), mask[:, None, None, :], new_slots

    def _prefill_inputs(self, chunk: ScheduledChunk, row: int) -> tuple[PrefillSpan, torch.Tensor]:
        """A prefill chunk, or a decode token followed by the drafts it verifies."""
        width = chunk.num_tokens + len(chunk.draft)
        end = chunk.start + width
        all_slots = self._slots_of(chunk.seq.block_table, end)
        gather = Slots.of(all_slots, self.page_size) if chunk.start > 0 else None
        span = PrefillSpan(row, row + width, chunk.start, gather)
        return span, all_slots[chunk.start :]


def _chunk_tokens(chunk: ScheduledChunk) -> list[int]:
    tokens = chunk.seq.token_ids[chunk.start : chunk.start + chunk.num_tokens]
    return tokens + list(chunk.draft)


def _padded(table: list[int], width: int) -> list[int]:
    table = table[:width]
    return table + [0] * (width - len(table))
