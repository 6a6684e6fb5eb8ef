"""Decode gRPC service: a thin adapter from protos to `DecodeWorker`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog
from opentelemetry.trace import Span

from kvmesh.engine.core.engine import TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.serving.async_engine import AsyncEngine
from kvmesh.errors import KvmeshError
from kvmesh.mesh import convert, metrics, tracing
from kvmesh.mesh.error_mapping import grpc_details, grpc_status
from kvmesh.mesh.grpc_server import deadline_of
from kvmesh.mesh.kv_events import stream_kv_events
from kvmesh.mesh.loads import load_to_pb
from kvmesh.mesh.request_gate import RequestGate
from kvmesh.proto.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.delivery import Deliveries
from services.decode.worker import DecodeJob, DecodeWorker

log = structlog.get_logger(__name__)
_TOKENS = metrics.GENERATION_TOKENS.labels("decode")  # per-token paths: the children, once
_PAGES_USED = metrics.KV_PAGES_USED.labels("decode")


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        worker: DecodeWorker,
        worker_id: str,
        deliveries: Deliveries,
        gate: RequestGate | None = None,
    ) -> None:
        self.worker = worker
        self.gate = gate or RequestGate()
        self.engine: AsyncEngine = worker.engine
        self.worker_id = worker_id
        self.deliveries = deliveries  # shared with the worker's delivery socket

    async def Generate(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        metrics.observe_message("decode", request.ByteSize())
        try:
            params = convert.sampling_from_pb(request.sampling)
        except KvmeshError as exc:
            await context.abort(grpc_status(exc), grpc_details(exc))
        tap = _DeliveryTap(self.deliveries, request.delivery_id, self.engine)
        span = tracing.start_span(
            "decode.generate",
            tracing.incoming_context(context.invocation_metadata()),
            request_id=request.request_id,
            resumed=len(request.resume_token_ids),
        )
        try:
            with self.gate.admit():  # bounded; refused while draining
                async for response in self._generate(request, params, tap, context, span):
                    yield response
        except KvmeshError as exc:
            log.warning("decode.request_failed", code=exc.code, error=str(exc))
            yield decode_pb2.DecodeResponse(
                request_id=request.request_id,
                error=common_pb2.Error(code=exc.code, message=str(exc)),
                first_index=tap.generated,
            )
        finally:
            span.set_attribute("generated", tap.generated)
            span.end()
            _PAGES_USED.set(self.engine.num_used_pages)

    async def _generate(
        self,
        request: decode_pb2.DecodeRequest,
        params: SamplingParams,
        tap: _DeliveryTap,
        context: grpc.aio.ServicerContext,
        span: Span,
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """The chunks to send on the Generate call (the others go on the delivery stream)."""
        stream = self.worker.generate(
            DecodeJob(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.prefill_address,
                request.cache_salt,
                tuple(request.resume_token_ids),
                deadline_of(context),
                span,
            ),
            tap if request.delivery_id else None,
        )
        async with contextlib.aclosing(stream):  # an abort reaches the engine before we return
            async for out in stream:
                response = _response(out, tap.generated)
                tap.generated += len(out.new_token_ids)
                _count(len(out.new_token_ids), self.engine)
                # the last chunk on this call (the ones before on the delivery stream)
                if (
                    out.finished
                    or not out.new_token_ids
                    or not self.deliveries.send(request.delivery_id, response)
                ):
                    metrics.observe_message("decode", response.ByteSize())
                    yield response

    async def Deliver(self, request: decode_pb2.DeliverRequest, context):
        try:
            async for message in self.deliveries.stream(request.delivery_id):
                metrics.observe_message("decode", message.ByteSize())
                yield message
        except KvmeshError as exc:
            await context.abort(grpc_status(exc), grpc_details(exc))

    async def Abort(self, request: decode_pb2.AbortRequest, context) -> decode_pb2.AbortResponse:
        return decode_pb2.AbortResponse(aborted=await self.worker.abort(request.request_id))

    async def SubscribeKvEvents(self, request, context):
        async for batch in stream_kv_events(self.engine, self.worker_id):
            yield batch

    async def GetLoads(self, request, context) -> decode_pb2.GetLoadsResponse:
        return decode_pb2.GetLoadsResponse(
            loads=[load_to_pb(self.engine.load(), self.worker_id, "decode")]
        )


class _DeliveryTap:
    """A request's chunks but the last, put on its caller's delivery stream by the engine thread
    right after each step (output_streams.Tap); `generated`: its tokens sent so far, either way."""

    def __init__(self, deliveries: Deliveries, delivery_id: str, engine: AsyncEngine) -> None:
        self._deliveries = deliveries
        self._delivery_id = delivery_id
        self._engine = engine
        self.generated = 0

    def take(self, out: TokenOutput) -> bool:
        if out.new_token_ids:  # a chunk of nothing is dropped (the gateway ignores them)
            if not self._deliveries.add(self._delivery_id, _response(out, self.generated)):
                return False  # the stream is gone: the chunks go on the Generate call
            _count(len(out.new_token_ids), self._engine)
        self.generated += len(out.new_token_ids)
        return True

    def flush(self) -> None:
        self._deliveries.flush(self._delivery_id)


def _count(tokens: int, engine: AsyncEngine) -> None:
    _TOKENS.inc(tokens)
    _PAGES_USED.set(engine.num_used_pages)


def _response(out: TokenOutput, before: int) -> decode_pb2.DecodeResponse:
    """The chunk of `out`, whose request sent `before` tokens so far."""
    msg = decode_pb2.DecodeResponse(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        logprobs=[convert.logprob_to_pb(lp) for lp in out.new_logprobs if lp is not None],
        first_index=before,
    )
    generated = before + len(out.new_token_ids)
    if out.finished:
        msg.finish_reason = convert.finish_to_pb(out.finish_reason)
        msg.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=generated,
                cached_tokens=out.num_cached_tokens,
            )
        )
    return msg


def add_to(servicer: DecodeServicer):
    def add(server: grpc.aio.Server) -> str:
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        return decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name

    return add
