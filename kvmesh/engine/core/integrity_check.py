"""The integrity check before each step: a scheduled sequence holding a page whose tag it does
not expect is taken out of the step -- its KV recomputed or the request aborted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kvmesh.engine.core.outputs import TokenOutput
from kvmesh.engine.core.scheduler import Scheduler, SchedulerOutput
from kvmesh.engine.core.sequence import FinishReason
from kvmesh.engine.kv import BlockManager
from kvmesh.engine.pool.block_tables import BlockTables
from kvmesh.engine.pool.integrity import PageTags
from kvmesh.errors import KvIntegrityError

log = structlog.get_logger(__name__)
MAX_INTEGRITY_RECOMPUTES = 3  # then a request that keeps failing its tags is aborted


@dataclass
class IntegrityCheck:
    page_tags: PageTags
    block_manager: BlockManager
    scheduler: Scheduler
    recompute: bool  # --kv-integrity-action recompute (else abort)
    abort: Callable[[str], bool]  # the engine's
    on_failure: Callable[[str], None] | None  # EngineListeners.integrity_failure

    def __call__(
        self, output: SchedulerOutput, tables: BlockTables
    ) -> tuple[SchedulerOutput, list[TokenOutput]]:
        """Take out of this step every scheduled sequence holding a page whose tag it does not
        expect: its KV is recomputed from its tokens (kv_integrity_action recompute: its pages
        freed, it waits first in line, its output goes on as if nothing happened) or it is
        aborted (alone). Those pages leave the prefix cache: no later request reuses them."""
        seqs = [chunk.seq for chunk in output.chunks]
        mismatched = self.page_tags.mismatched(tables, [s.seq_id for s in seqs])
        if not mismatched:
            return output, []
        failed: list[TokenOutput] = []
        for index, pages in mismatched:
            seq = seqs[index]
            reported = seq.finalizing is not None  # its finish was already delivered
            recompute = (
                self.recompute
                and not reported
                and seq.integrity_recomputes < MAX_INTEGRITY_RECOMPUTES
            )
            log.error(
                "kv.integrity_failure",
                request_id=seq.seq_id,
                pages=pages,
                action="recompute" if recompute else "abort",
            )
            self.block_manager.discard_cached(pages)
            if self.on_failure is not None:
                self.on_failure(seq.seq_id)
            if recompute:
                seq.integrity_recomputes += 1
                self.scheduler.recompute(seq.seq_id)
                continue
            self.abort(seq.seq_id)
            if not reported:
                error = KvIntegrityError(
                    f"request {seq.seq_id} aborted: KV page(s) {pages} no longer carry the "
                    "integrity tag this request expects (reallocated, overwritten or not "
                    "fully transferred)"
                )
                failed.append(
                    TokenOutput(
                        seq.seq_id,
                        [],
                        [],
                        True,
                        FinishReason.ABORT,
                        seq.num_prompt_tokens,
                        seq.num_cached_tokens,
                        error,
                    )
                )
        return output.without({seqs[index].seq_id for index, _ in mismatched}), failed
