"""The ranks of one tensor-parallel worker as a torch.distributed group (gloo on CPU, on
loopback; NCCL on GPUs: the platform's `join_group`), and the all-reduce that joins a split
layer's partial outputs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvmesh.engine.layers.linear import dense_matmul
from kvmesh.engine.layers.norm import rms_norm
from kvmesh.engine.parallel.shm_reduce import ShmAllReduce
from kvmesh.errors import EngineFailure, InvalidRequestError


class AllReduced:
    """A split layer (attention or MLP) whose partial outputs the ranks sum: in fp32, so a bf16
    model rounds the whole sum once, as one rank would round its own."""

    def __init__(self, inner: Any, group: dist.ProcessGroupGloo, shm: ShmAllReduce | None) -> None:
        self.inner, self.group, self.shm = inner, group, shm

    def __call__(self, *args: Any) -> torch.Tensor:
        out = self.inner(*args)
        total = out.float().contiguous()  # out itself where it is fp32 and contiguous already
        _sum(self.group, self.shm, total)
        return total if total is out else total.to(out.dtype)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def all_reduced_layers(
    model: Any, vocab: range, group: dist.ProcessGroupGloo, shm: ShmAllReduce | None = None
) -> None:
    """A sharded model joined to its ranks: each decoder layer's attention and MLP summed over
    them (through shared memory where the tensor fits, else gloo), the embedding and LM head
    split by token id (`vocab`: this rank's ids)."""
    vocab_parallel(model, vocab, group, shm)
    for layer in model.layers:
        layer.attention = AllReduced(layer.attention, group, shm)
        layer.mlp = AllReduced(layer.mlp, group, shm)


def reduce_capacity(config: Any, max_rows: int, max_seqs: int) -> int:
    """Floats a shared-memory slot holds: a step's rows of hidden states, or the logits of
    its sampled rows (one per sequence)."""
    return max(config.hidden_size * max_rows, config.vocab_size * max_seqs)


class VocabParallel:
    """A sharded model's token embedding and LM head split by token id: rank r holds the table
    rows of its ids. A lookup takes each rank's rows (zeros for ids it lacks) and sums them, an
    LM head writes each rank's logits into its columns of zeros and sums them: x + 0 is x, so
    the rows and logits are those of the whole table (the logits of each slice's own matmul).
    Every rank runs both, in the same order (the LM head's sum is a collective too)."""

    def __init__(self, model: Any, vocab: range, reduce: Callable[[torch.Tensor], None]) -> None:
        self.model, self.vocab, self.reduce = model, vocab, reduce
        self.inner = model.ends  # (a pipeline stage holds the tables of its ends only)
        if any(
            t is not None and not isinstance(t, torch.Tensor) for t in (model.embed, model.lm_head)
        ):
            raise InvalidRequestError("tensor parallelism needs dense embeddings (no INT4 table)")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.model.embed is None:
            return self.inner.embed(ids)
        local = ids - self.vocab.start
        held = (local >= 0) & (local < len(self.vocab))
        rows = F.embedding(local.clamp(0, len(self.vocab) - 1), self.model.embed)
        total = (rows * held.unsqueeze(-1)).float()
        self.reduce(total)
        return total.to(rows.dtype)

    def hand_on(self, hidden: torch.Tensor) -> None:
        self.inner.hand_on(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.model.norm is None:
            return self.inner.logits(hidden)
        normed = rms_norm(hidden, self.model.norm, self.model.config.rms_norm_eps)
        part = dense_matmul(normed, self.model.lm_head)
        vocab = self.model.config.vocab_size
        total = torch.zeros(part.shape[0], vocab, dtype=torch.float32, device=part.device)
        total[:, self.vocab.start : self.vocab.stop] = part
        self.reduce(total)
        return total.to(part.dtype)


def vocab_parallel(
    model: Any, vocab: range, group: dist.ProcessGroupGloo, shm: ShmAllReduce | None
) -> None:
    """The model's embedding lookup and LM head, split by token id over the ranks."""
    model.join(VocabParallel(model, vocab, functools.partial(_sum, group, shm)))


def _sum(group: dist.ProcessGroupGloo, shm: ShmAllReduce | None, total: torch.Tensor) -> None:
    if shm is not None and shm.fits(total):  # every rank decides by the size alone
        shm(total)
        return
    try:
        group.allreduce([total]).wait()
    except RuntimeError as exc:
        raise EngineFailure(f"a tensor-parallel rank of this engine is gone: {exc}") from exc
