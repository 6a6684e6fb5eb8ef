"""Pipeline stages of one engine joined to each other (shard.py has what each holds).

Every rank gets every forward pass from rank 0 (ranks.py), so each builds the same attention
metadata and picks the same sampled rows. Stage s > 0 takes its input rows from stage s - 1 (the
rank of the same tensor-parallel index) instead of looking tokens up; a stage before the last
hands its output rows on; the last stage's tensor-parallel rank 0 sends the logits to global
rank 0, which samples. Rows travel in fp32 over gloo point-to-point (bf16 -> fp32 -> bf16 is
exact). A pass may run in micro-batches (EngineConfig.pipeline_micro_batches; sends do not
wait), so a stage runs its next group while the next stage runs this one: on a machine of few
cores the extra passes cost more than the overlap gives, so one group is the default
(docs/benchmarks-history.md, "Pipeline stages and micro-batches").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.errors import EngineFailure

_ROWS, _LOGITS = 1, 2  # message tags
_IN_FLIGHT = 8  # sends not waited for yet, per rank
_CHECK_EVERY_S = 0.5  # how often a waiting receive asks whether the ranks still run


class Pipeline:
    def __init__(
        self,
        model: Any,
        shard: TensorShard,
        group: dist.ProcessGroupGloo,
        alive: Callable[[], bool],
    ) -> None:
        """alive: whether the ranks this one may wait on still run (polled while it waits: a
        rank of a later stage may die while that stage's peers wait in their own sum)."""
        self.model, self.shard, self.group, self.alive = model, shard, group, alive
        self.dtype = model.dtype
        self.hidden = model.config.hidden_size
        base = shard.stage * shard.world + shard.rank
        self.previous = None if shard.first else base - shard.world
        self.next = None if shard.last else base + shard.world
        self.sends_logits = shard.last and shard.rank == 0 and base != 0
        self._sending: list[tuple[Any, torch.Tensor]] = []  # sends in flight, their tensors
        self.inner = model.ends  # the ends it had (the vocabulary split over its ranks)

    def install(self) -> None:
        """The stage's links become the model's ends (around the ends it had)."""
        self.model.join(self)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.previous is None:
            return self.inner.embed(ids)
        rows = self._receive((ids.shape[0], self.hidden), self.previous, _ROWS, ids.device)
        return rows.to(self.dtype)

    def hand_on(self, hidden: torch.Tensor) -> None:
        self.inner.hand_on(hidden)
        if self.next is not None:
            self._send(hidden, self.next, _ROWS)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's; rank 0 receives them (it samples); other stages have none."""
        if self.shard.last:
            out = self.inner.logits(hidden)
            if self.sends_logits:
                self._send(out, 0, _LOGITS)
            return out
        if self.shard.stage == 0 and self.shard.rank == 0:
            return self._logits_from_last(hidden)
        return hidden[:, :0]

    def _logits_from_last(self, hidden: torch.Tensor) -> torch.Tensor:
        last = (self.shard.stages - 1) * self.shard.world
        shape = (hidden.shape[0], self.model.config.vocab_size)
        return self._receive(shape, last, _LOGITS, hidden.device).to(self.dtype)

    def _wait(self, work: Any) -> None:
        """Wait for a receive on a thread of its own, asking `alive` every half second (gloo's
        recv work cannot be polled): a rank that died behind the sender ends the wait."""
        done, failed = threading.Event(), []
        threading.Thread(target=_waited, args=(work, done, failed), daemon=True).start()
        while not done.wait(_CHECK_EVERY_S):
            if not self.alive():
                raise EngineFailure("a parallel rank of this engine is gone")
        if failed:
            raise failed[0]

    def _send(self, tensor: torch.Tensor, rank: int, tag: int) -> None:
        """Without waiting for it (a bounded number in flight)."""
        try:
            while len(self._sending) >= _IN_FLIGHT:
                self._sending.pop(0)[0].wait()
            rows = tensor.to(torch.float32, copy=True)  # its own buffer: sent later
            self._sending.append((self.group.send([rows], rank, tag), rows))
        except RuntimeError as exc:
            raise EngineFailure(f"pipeline rank {rank} of this engine is gone: {exc}") from exc

    def _receive(
        self, shape: tuple[int, int], rank: int, tag: int, device: torch.device
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=device)
        try:
            self._wait(self.group.recv([out], rank, tag))
        except RuntimeError as exc:
            raise EngineFailure(f"pipeline rank {rank} of this engine is gone: {exc}") from exc
        return out


def _waited(work: Any, done: threading.Event, failed: list[BaseException]) -> None:
    try:
        work.wait()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        failed.append(exc)
    finally:
        done.set()
