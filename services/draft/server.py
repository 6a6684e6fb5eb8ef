"""Draft gRPC service: a thin adapter from protos to an `EagleProposer` (one per process).

Every proposer call runs on one worker thread of the servicer (one thread runs torch here:
kvmesh/engine/serving/engine_thread.py), so calls run one at a time: the head is small and a Propose call
covers a whole decode batch, and one call at a time keeps each request's state consistent.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from kvmesh.engine.spec.eagle_proposer import EagleProposer
from kvmesh.mesh import convert, metrics
from kvmesh.proto.v1 import draft_pb2, draft_pb2_grpc

log = structlog.get_logger(__name__)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, proposer: EagleProposer) -> None:
        self.proposer = proposer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")

    async def _on_thread(self, fn, *args):
        """fn(*args) on the servicer's one thread, after the calls before it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context
    ) -> draft_pb2.ProposeResponse:
        metrics.observe_message("draft", request.ByteSize())
        try:
            outputs = await self._on_thread(self._propose, request)
        except (ValueError, RuntimeError, IndexError) as exc:
            log.warning("draft.bad_request", error=str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid_request_error: {exc}")
        return draft_pb2.ProposeResponse(outputs=outputs)

    def _propose(self, request: draft_pb2.ProposeRequest) -> list[draft_pb2.DraftOutput]:
        outputs = []
        for item in request.inputs:
            rows = item.committed
            if rows.rows:
                features = convert.feature_rows_from_pb(rows)
                tokens = list(rows.next_tokens)
                if len(tokens) != rows.rows:
                    raise ValueError(f"{rows.rows} feature rows but {len(tokens)} next tokens")
                if rows.fused:
                    self.proposer.seed(item.request_id, features, rows.start_position, tokens)
                else:
                    self.proposer.observe(item.request_id, features, tokens, rows.start_position)
            drafts = self.proposer.draft(item.request_id, item.num_draft_tokens)
            outputs.append(
                draft_pb2.DraftOutput(request_id=item.request_id, draft_token_ids=drafts)
            )
        return outputs

    async def Release(self, request, context) -> draft_pb2.ReleaseDraftResponse:
        await self._on_thread(lambda: self.proposer.release(request.request_ids, force=True))
        return draft_pb2.ReleaseDraftResponse(released=len(request.request_ids))

    async def GetInfo(self, request, context) -> draft_pb2.GetDraftInfoResponse:
        c = self.proposer.head.config
        return draft_pb2.GetDraftInfoResponse(
            target=c.target,
            capture_layers=list(c.capture_layers),
            window=c.window,
            hidden_size=c.hidden_size,
            draft_vocab_size=c.draft_vocab_size,
        )


def add_to(servicer: DraftServicer):
    def add(server: grpc.aio.Server) -> str:
        draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
        return draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name

    return add
