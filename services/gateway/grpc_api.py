"""The gRPC `Gateway` service: text, chat or token ids in; token ids and text deltas out."""

from __future__ import annotations

import uuid
from dataclasses import replace

import grpc
import structlog

from kvmesh.agent.tool_grammar import reply_grammar
from kvmesh.agent.tool_parsers import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
)
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidRequestError, KvmeshError
from kvmesh.mesh import convert
from kvmesh.mesh.error_mapping import grpc_details, grpc_status
from kvmesh.mesh.grpc_server import deadline_of
from kvmesh.proto.v1 import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.auth import request_salt, tenant_salt
from services.gateway.backend import GenerateBackend, GenerateInput, unique_request_id
from services.gateway.generation import ReplyDetokenizer
from services.gateway.grpc_chat import conversation_of
from services.gateway.openai_protocol import ToolSetup, chat_prompt
from services.gateway.served import ServedModel, check_model, output_budget

log = structlog.get_logger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self, backend: GenerateBackend, tokenizer: Tokenizer, live_counts, served: ServedModel
    ) -> None:
        self.backend = backend
        self.served = served  # names, limits, tool-call format: as the REST front's
        self.tokenizer = tokenizer
        self._live_counts = live_counts  # () -> (prefill workers, decode workers)
        # (tenant, the client's request id) -> the mesh ids of its calls in flight: an Abort
        # reaches only the requests of the tenant (API key) that sends it
        self._running: dict[tuple[str, str], set[str]] = {}

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        structlog.contextvars.bind_contextvars(request_id=request_id)
        owner = (_tenant(context), request_id)
        mesh_id = unique_request_id(request_id)
        self._running.setdefault(owner, set()).add(mesh_id)
        try:
            async for message in self._generate(request, request_id, mesh_id, context):
                yield message
        finally:
            running = self._running.get(owner, set())
            running.discard(mesh_id)
            if not running:
                self._running.pop(owner, None)

    async def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        request_id: str,
        mesh_id: str,
        context: grpc.aio.ServicerContext,
    ):
        try:
            prompt, params, tools = self._parse(request)
        except KvmeshError as exc:
            await context.abort(grpc_status(exc), grpc_details(exc))
        parser = tools.parser_object() if tools is not None else None
        detok = ReplyDetokenizer(self.tokenizer, params, params.stop, prompt, parser)
        calls = ToolCallStream(parser) if parser is not None else None
        completion = 0
        answered = False
        try:
            async for chunk in self.backend.generate(
                GenerateInput(
                    mesh_id,
                    prompt,
                    params,
                    *_routing(request, context),
                    deadline=deadline_of(context),
                )
            ):
                completion += len(chunk.token_ids)
                result = detok.push(chunk.token_ids, final=chunk.finish_reason is not None)
                finish = chunk.finish_reason
                if result.stopped_on is not None and finish is None:
                    await self.backend.abort(mesh_id)
                    finish = "stop"
                message = _response(
                    request_id, chunk, result.delta, finish, len(prompt), completion
                )
                if calls is not None:
                    _read_calls(message, calls.push(result.delta, final=finish is not None))
                yield message
                answered = True
                if finish is not None:
                    return
        except KvmeshError as exc:
            log.warning("gateway.grpc_failed", code=exc.code, error=str(exc))
            if not answered:  # nothing sent yet: the call's status says it (RESOURCE_EXHAUSTED..)
                await context.abort(grpc_status(exc), grpc_details(exc))
            yield gateway_pb2.GenerateResponse(
                request_id=request_id, error=common_pb2.Error(code=exc.code, message=str(exc))
            )

    def _parse(self, request: gateway_pb2.GenerateRequest):
        check_model({"model": request.model or None}, self.served)
        kind = request.WhichOneof("input")
        conversation = None
        if kind == "prompt":
            prompt = self.tokenizer.encode(request.prompt)
        elif kind == "chat":
            conversation = conversation_of(request.chat)
            prompt = chat_prompt(conversation, self.tokenizer)
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise InvalidRequestError("one of prompt, chat or token_ids is required")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        params = convert.sampling_from_pb(request.sampling, tuple(request.stop))
        if conversation is not None:
            grammar = reply_grammar(
                conversation,
                self.served.tool_parser,
                self.tokenizer.hf,
                params.grammar,
                "sampling.grammar",
            )
            params = replace(params, grammar=grammar)
        if request.include_stop_str_in_output:
            params = replace(params, include_stop_str_in_output=True)
        budget = output_budget("chat", len(prompt), params.max_tokens, self.served)
        params = replace(params, max_tokens=budget.max_tokens)
        tools = ToolSetup.of(conversation, self.served.tool_parser) if conversation else None
        return prompt, params, tools

    async def Abort(self, request: decode_pb2.AbortRequest, context) -> decode_pb2.AbortResponse:
        """Abort the caller's own requests of that id (aborted: there was one)."""
        mesh_ids = list(self._running.get((_tenant(context), request.request_id), ()))
        for mesh_id in mesh_ids:
            await self.backend.abort(mesh_id)
        return decode_pb2.AbortResponse(aborted=bool(mesh_ids))

    async def GetModelInfo(self, request, context) -> gateway_pb2.GetModelInfoResponse:
        prefill, decode = self._live_counts()
        return gateway_pb2.GetModelInfoResponse(
            model=self.backend.model_name,
            max_model_len=self.backend.max_model_len,
            vocab_size=self.tokenizer.vocab_size,
            prefill_workers=prefill,
            decode_workers=decode,
        )


def _tenant(context) -> str:
    return tenant_salt(dict(context.invocation_metadata() or ()))


def _routing(request: gateway_pb2.GenerateRequest, context) -> tuple[str | None, str]:
    """Session id and cache salt: the message fields, else the same names as metadata."""
    metadata = dict(context.invocation_metadata() or ())
    session = request.session_id or metadata.get("x-session-affinity") or None
    salt = request_salt(metadata, request.cache_salt or metadata.get("x-kvmesh-cache-salt", ""))
    return session, salt


def _response(
    request_id, chunk, delta: str, finish: str | None, prompt_tokens: int, completion: int
):
    msg = gateway_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=chunk.token_ids,
        text=delta,
        logprobs=[convert.logprob_to_pb(lp) for lp in chunk.logprobs if lp is not None],
    )
    if finish is not None:
        from kvmesh.engine.core.sequence import FinishReason

        msg.finish_reason = convert.finish_to_pb(FinishReason(finish))
        msg.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                cached_tokens=chunk.cached_tokens,
            )
        )
    return msg


def _read_calls(message: gateway_pb2.GenerateResponse, events) -> None:
    """With tools: the message's text is only the content; calls go to tool_calls."""
    message.text = "".join(e.text for e in events if isinstance(e, ContentDelta))
    for event in events:
        if isinstance(event, CallStart):
            message.tool_calls.add(index=event.index, id=event.id, name=event.name)
        elif isinstance(event, ArgumentsDelta):
            message.tool_calls.add(index=event.index, arguments=event.text)


def add_to(servicer: GatewayServicer):
    def add(server: grpc.aio.Server) -> str:
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name

    return add
