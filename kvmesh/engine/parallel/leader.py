"""Rank 0's runner in a parallel engine: each forward pass goes to the other ranks (ranks.py)
as plain data before rank 0 runs its own shard."""

from __future__ import annotations

from typing import Any

from kvmesh.engine.parallel.ranks import Ranks
from kvmesh.engine.runner.runner import ModelRunner, RunnerOptions
from kvmesh.errors import EngineFailure


class LeaderRunner(ModelRunner):
    """Rank 0's runner: what it applies is queued for the other ranks, and each forward pass
    is sent to them before its own shard runs (the same passes, in the same order)."""

    def __init__(
        self, model: Any, kv: Any, attention: Any, options: RunnerOptions, ranks: Ranks
    ) -> None:
        super().__init__(model, kv, attention, options)
        self.ranks = ranks
        self._ops: list[tuple[str, Any]] = []
        self._every_row = False  # the pass's LM head: every row (a score) or the sampled ones
        self._sent = False  # this step's pass went out whole (its micro-batches run after)

    def apply(self, plan: Any) -> None:
        self._ops.append(("apply", plan))
        super().apply(plan)

    def execute(self, chunks: Any) -> Any:
        return self._guarded(self._execute_sent, chunks)

    def _execute_sent(self, chunks: Any) -> Any:
        """The whole step to the other ranks first: each splits it into the same micro-batches."""
        self._send(chunks)
        self._sent = True
        try:
            return super().execute(chunks)
        finally:
            self._sent = False

    def score_rows(self, plan: Any) -> Any:
        self._every_row = True
        try:
            return self._guarded(super().score_rows, plan)
        finally:
            self._every_row = False

    def _guarded(self, run: Any, arg: Any) -> Any:
        """A whole pass (its layers' and its LM head's sums): if it fails here, the other ranks
        may wait in a sum this rank will never reach, and matched calls cannot be restored, so
        the ranks stop and every later pass fails."""
        try:
            return run(arg)
        except EngineFailure:
            self.ranks.close()
            raise
        except BaseException as exc:
            self.ranks.close()
            raise EngineFailure(f"a tensor-parallel pass failed on rank 0: {exc}") from exc

    def score(self, plan: Any) -> Any:
        try:
            return super().score(plan)
        finally:
            self._ops.extend(("forget", chunk.req_id) for chunk in plan.chunks)

    def _forward(self, chunks: Any):
        if not self._sent:  # a score: sent here, after the plan it applies
            self._send(chunks)
        return super()._forward(chunks)

    def _send(self, chunks: Any) -> None:
        ops, self._ops = self._ops, []
        self.ranks.send(("forward", ops, chunks, self._every_row))
