"""Prefill gRPC service: a thin adapter from protos to `PrefillWorker`."""

from __future__ import annotations

import grpc
import structlog

from kvmesh.errors import KvmeshError
from kvmesh.mesh import convert, metrics, tracing
from kvmesh.mesh.error_mapping import grpc_details, grpc_status
from kvmesh.mesh.grpc_server import deadline_of
from kvmesh.mesh.kv_events import stream_kv_events
from kvmesh.mesh.loads import load_to_pb
from kvmesh.mesh.request_gate import RequestGate
from kvmesh.proto.v1 import decode_pb2, prefill_pb2, prefill_pb2_grpc
from services.prefill.worker import PrefillWorker

log = structlog.get_logger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self, worker: PrefillWorker, worker_id: str, gate: RequestGate | None = None
    ) -> None:
        self.worker = worker
        self.gate = gate or RequestGate()
        self.worker_id = worker_id

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context
    ) -> prefill_pb2.PrefillResponse:
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        metrics.observe_message("prefill", request.ByteSize())
        try:
            params = convert.sampling_from_pb(request.sampling)
            parent = tracing.incoming_context(context.invocation_metadata())
            with (
                self.gate.admit(),  # bounded; refused while draining
                tracing.span("prefill.prefill", parent, request_id=request.request_id),
            ):
                result = await self.worker.prefill(
                    request.request_id,
                    list(request.prompt_token_ids),
                    params,
                    request.destination,
                    request.cache_salt,
                    list(request.resume_token_ids),
                    deadline_of(context),
                )
        except KvmeshError as exc:
            log.warning("prefill.failed", code=exc.code, error=str(exc))
            await context.abort(grpc_status(exc), grpc_details(exc))
        first = result.first
        response = prefill_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=first.new_token_ids[0],
            cached_tokens=first.num_cached_tokens,
            bytes_transferred=result.bytes_transferred,
            pages_transferred=result.pages_transferred,
        )
        if result.draft_window is not None:
            fused, start = result.draft_window
            tokens = [*request.prompt_token_ids, *request.resume_token_ids, first.new_token_ids[0]]
            response.draft_window.CopyFrom(
                convert.feature_rows_to_pb(
                    fused, start, tokens[start + 1 : start + 1 + len(fused)], fused=True
                )
            )
        if first.new_logprobs and first.new_logprobs[0] is not None:
            response.first_logprob.CopyFrom(convert.logprob_to_pb(first.new_logprobs[0]))
        metrics.observe_message("prefill", response.ByteSize())
        return response

    async def Abort(self, request: decode_pb2.AbortRequest, context) -> decode_pb2.AbortResponse:
        return decode_pb2.AbortResponse(aborted=await self.worker.abort(request.request_id))

    async def SubscribeKvEvents(self, request, context):
        async for batch in stream_kv_events(self.worker.engine, self.worker_id):
            yield batch

    async def GetLoads(self, request, context) -> decode_pb2.GetLoadsResponse:
        load = load_to_pb(self.worker.engine.load(), self.worker_id, "prefill")
        return decode_pb2.GetLoadsResponse(loads=[load])


def add_to(servicer: PrefillServicer):
    def add(server: grpc.aio.Server) -> str:
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        return prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name

    return add
