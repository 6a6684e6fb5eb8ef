"""GenerateBackend over the mesh: route, call Decode.Generate (which pulls in a prefill worker),
its chunks but the last coming on the worker's delivery stream (delivery.py), retry on another
worker when one is gone before the first token, migrate a stream whose worker dies after it,
abort down the chain."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog
from opentelemetry.trace import Span

from kvmesh.config.gateway import StreamConfig
from kvmesh.errors import (
    DeadlineExceededError,
    EngineFailure,
    OverloadedError,
    PrefillOverloadedError,
    PrefillUnavailable,
)
from kvmesh.mesh import convert, metrics, tls, tracing
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.error_mapping import error_from_code, error_from_grpc
from kvmesh.mesh.grpc_server import channel
from kvmesh.mesh.request_gate import RequestGate
from kvmesh.proto.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.routing.prefix import PromptKey
from kvmesh.routing.router import Router, WorkerUnavailable
from kvmesh.routing.sessions import Pin, SessionStore
from services.gateway.backend import GenerateChunk, GenerateInput
from services.gateway.delivery import Delivery

log = structlog.get_logger(__name__)
MAX_ATTEMPTS = 3  # workers tried before a request's first token
DEFAULT_MIGRATION_LIMIT = StreamConfig.migration_limit  # moves of a stream after it started
DEFAULT_MAX_INFLIGHT = StreamConfig.max_inflight_requests  # sequences through one gateway
REFUSED_RETRY_S = 5.0  # a delivery socket that refused a connection is tried again after this
_now = time.monotonic


@dataclasses.dataclass(frozen=True)
class Leg:
    """One worker call of a request: the id it runs under there (a migrated request's differs:
    the worker it left may still hold the old one), the tokens already sent, its prompt key."""

    request_id: str
    resumed: tuple[int, ...]
    prompt: PromptKey  # the prompt and the resumed tokens (what the worker's KV will hold)


class MeshBackend:
    def __init__(
        self,
        router: Router,
        model_name: str,
        max_model_len: int,
        sessions: SessionStore | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        self.router = router
        self.migration_limit = migration_limit
        # sequences streaming through this gateway at once
        self.gate = RequestGate(
            max_inflight,
            metrics.REQUESTS_IN_FLIGHT.labels("gateway").set,
            "the gateway",
            "--max-inflight-requests",
        )
        self.sessions = sessions
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._where: dict[str, dict[str, str]] = {}  # request id -> {its id on a worker: address}
        self._aborted: set[str] = set()  # requests aborted here: no leg starts after that
        self._deliveries: dict[str, Delivery] = {}  # delivery socket -> its open stream
        self._refused: dict[str, float] = {}  # delivery socket -> when to try it again

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """The request's chunks. A worker gone before the first token: tried on another (at
        most MAX_ATTEMPTS); one at its limit: the next, until every one was (OverloadedError:
        429). A decode worker that dies or breaks mid-stream: the request migrates (at most
        `migration_limit` times) -- another worker goes on after the tokens already sent
        (`resume_token_ids`), so the stream continues without a repeat or a gap."""
        with self.gate.admit():
            self._where[request.request_id] = {}  # an abort from here on is kept
            root = tracing.start_span(
                "gateway.generate",
                request_id=request.request_id,
                prompt_tokens=len(request.prompt_token_ids),
            )
            try:  # closed here, not when collected: a leg cut short has its call cancelled now
                async with contextlib.aclosing(self._generate(request, root)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            finally:
                root.end()
                self._where.pop(request.request_id, None)
                self._aborted.discard(request.request_id)

    async def _generate(self, request: GenerateInput, root: Span) -> AsyncIterator[GenerateChunk]:
        pin = await self._lookup(request.session_id)
        bad_decode: set[str] = set()
        bad_prefill: set[str] = set()
        sent: list[int] = []  # tokens the caller has
        attempts = migrations = 0
        full: OverloadedError | None = None  # the last worker found at its limit
        nonce = uuid.uuid4().hex[:8]  # two requests under one client-chosen id stay apart
        while True:
            if request.request_id in self._aborted:  # before this leg began (routing, a retry)
                yield GenerateChunk(finish_reason="abort")
                return
            leg = self._leg(request, sent, migrations, nonce)
            try:
                decode = self.router.pick(
                    "decode", self._decode_cost(request), bad_decode, pin and pin.decode, leg.prompt
                ).worker
            except WorkerUnavailable as exc:
                if full is None:
                    raise
                raise OverloadedError(f"every decode worker is at its limit ({full})") from exc
            prefill = self._pick_prefill(leg, decode, bad_prefill, pin and pin.prefill)
            started = False
            chunks = self._stream(request, leg, decode, prefill, root)
            try:
                async with contextlib.aclosing(chunks):  # a leg cut short: its call cancelled
                    async for chunk in chunks:
                        if not started and request.session_id and self.sessions:
                            pinned = Pin(prefill.worker_id if prefill else "", decode.worker_id)
                            await self.sessions.pin(request.session_id, pinned)
                        started = True
                        sent.extend(chunk.token_ids)
                        if leg.resumed:  # the worker counts resumed tokens' pages as cached
                            cached = min(chunk.cached_tokens, len(request.prompt_token_ids))
                            chunk = dataclasses.replace(chunk, cached_tokens=cached)
                        yield chunk
                return
            except OverloadedError as exc:
                full = exc  # another worker may have room: each is tried once
                _exclude(exc, decode, prefill, bad_decode, bad_prefill)
            except (WorkerUnavailable, EngineFailure) as exc:
                if sent:
                    outcome = "migrated" if migrations < self.migration_limit else "exhausted"
                    metrics.REQUEST_MIGRATIONS.labels("gateway", outcome).inc()
                    log.warning(
                        "gateway.migrate",
                        decode=decode.worker_id,
                        sent=len(sent),
                        outcome=outcome,
                        error=str(exc),
                    )
                    if outcome == "exhausted":
                        raise
                    migrations += 1
                else:
                    attempts += 1
                    if attempts == MAX_ATTEMPTS:
                        raise
                    log.warning("gateway.retry", decode=decode.worker_id, error=str(exc))
                _exclude(exc, decode, prefill, bad_decode, bad_prefill)

    def _leg(self, request: GenerateInput, sent: list[int], migrations: int, nonce: str) -> Leg:
        """The next worker call of `request`: after `migrations` moves, `sent` tokens sent."""
        worker_request_id = f"{request.request_id}~{nonce}" + (
            f"m{migrations}" if migrations else ""
        )
        tokens = [*request.prompt_token_ids, *sent]
        prompt = PromptKey(self.model_name, tokens, request.cache_salt)
        return Leg(worker_request_id, tuple(sent), prompt)

    async def _lookup(self, session_id: str | None) -> Pin | None:
        if not session_id or self.sessions is None:
            return None
        return await self.sessions.lookup(session_id)

    def _pick_prefill(
        self, leg: Leg, decode: WorkerInfo, exclude: set[str], preferred: str | None
    ) -> WorkerInfo | None:
        """A prefill worker whose pages `decode` can take; None: decode prefills it itself."""
        try:
            cost = len(leg.prompt.token_ids)
            return self.router.pick(
                "prefill", cost, exclude, preferred or None, leg.prompt, paired_with=decode
            ).worker
        except WorkerUnavailable:
            return None

    @staticmethod
    def _decode_cost(request: GenerateInput) -> int:
        return len(request.prompt_token_ids) + request.params.max_tokens

    async def _stream(
        self,
        request: GenerateInput,
        leg: Leg,
        decode: WorkerInfo,
        prefill: WorkerInfo | None,
        root: Span,
    ) -> AsyncIterator[GenerateChunk]:
        stub = decode_pb2_grpc.DecodeStub(self._channel(decode.grpc_address))
        timeout = None
        if request.deadline is not None:
            timeout = request.deadline - _now()
            if timeout <= 0:
                raise DeadlineExceededError(f"request {request.request_id}: its deadline passed")
        message = decode_pb2.DecodeRequest(
            request_id=leg.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=convert.sampling_to_pb(request.params),
            prefill_address=prefill.grpc_address if prefill else "",
            cache_salt=request.cache_salt,
            resume_token_ids=leg.resumed,
        )
        legs = self._where.setdefault(request.request_id, {})
        legs[leg.request_id] = decode.grpc_address  # before the call: an abort reaches it
        held = self._decode_cost(request)
        prompt = leg.prompt
        delivery = self._delivery(decode.delivery_address)
        if delivery is not None and delivery.serves(leg.request_id):
            delivery = None  # a request of this id runs there already: this one on its call
        if delivery is not None:
            message.delivery_id = delivery.id
        try:
            with self.router.holding(decode.worker_id, held), contextlib.ExitStack() as prefilling:
                prefilling.enter_context(self._holding_prefill(prefill, len(prompt.token_ids)))
                call_span = tracing.start_span(
                    "gateway.decode_call", root, decode=decode.worker_id, resumed=len(leg.resumed)
                )
                call = stub.Generate(
                    message, timeout=timeout, metadata=tracing.outgoing_metadata(call_span)
                )
                responses = call if delivery is None else delivery.chunks(leg.request_id, call)
                first = True
                try:
                    async for response in responses:
                        chunk = _chunk(response)  # raises a worker's error
                        if first and chunk.token_ids:  # the prompt is in pages, prefilled
                            first = False
                            prefilling.close()
                            self.router.prefilled(prompt, decode, prefill, chunk.cached_tokens)
                        yield chunk
                finally:
                    call.cancel()  # no-op when finished; cancels decode when the client left
                    call_span.end()
                    if delivery is not None:
                        await responses.aclose()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceededError(
                    f"request {request.request_id}: its deadline passed"
                ) from exc
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise WorkerUnavailable(
                    f"decode worker {decode.worker_id} unavailable: {exc.details()}"
                ) from exc
            raise error_from_grpc(exc.code(), exc.details()) from exc
        finally:
            legs.pop(leg.request_id, None)

    def _holding_prefill(self, prefill: WorkerInfo | None, tokens: int):
        if prefill is None:
            return contextlib.nullcontext()
        return self.router.holding(prefill.worker_id, tokens)

    async def abort(self, request_id: str) -> None:
        """End the request on the worker running it; one between legs starts no other."""
        legs = self._where.get(request_id)
        if legs is None:
            return  # over, or never here
        self._aborted.add(request_id)
        for worker_request_id, address in list(legs.items()):
            stub = decode_pb2_grpc.DecodeStub(self._channel(address))
            try:
                await stub.Abort(decode_pb2.AbortRequest(request_id=worker_request_id), timeout=5)
            except grpc.aio.AioRpcError as exc:
                log.warning("gateway.abort_failed", request_id=request_id, code=exc.code().name)

    def _delivery(self, address: str) -> Delivery | None:
        """The open delivery stream to the delivery socket `address` (opened now if there is
        none: an ended one is forgotten as it ends); None where the worker advertises none or
        its socket refused the last try (then the chunks come on Generate)."""
        if not address or self._refused.get(address, 0.0) > _now() or tls.current() is not None:
            return None  # (a plain socket: under TLS every chunk comes on the Generate call)
        delivery = self._deliveries.get(address)
        if delivery is None:
            delivery = self._deliveries[address] = Delivery(address, self._delivery_ended)
        return delivery

    def _delivery_ended(self, delivery: Delivery) -> None:
        """Forget a stream that ended: the next request opens another (a refused one's after
        REFUSED_RETRY_S, not one connection attempt and warning per request)."""
        if self._deliveries.get(delivery.address) is delivery:
            del self._deliveries[delivery.address]
        if not delivery.connected:
            self._refused[delivery.address] = _now() + REFUSED_RETRY_S

    def close(self) -> None:
        """End every delivery stream (the gateway is stopping)."""
        for delivery in list(self._deliveries.values()):
            delivery.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address)
        return self._channels[address]


def _exclude(
    exc: Exception,
    decode: WorkerInfo,
    prefill: WorkerInfo | None,
    bad_decode: set[str],
    bad_prefill: set[str],
) -> None:
    """Leave the worker at fault out of the request's next tries: the prefill worker when it
    failed or was full (none left: the decode worker prefills itself), else the decode one."""
    if isinstance(exc, PrefillUnavailable | PrefillOverloadedError) and prefill is not None:
        bad_prefill.add(prefill.worker_id)
    else:
        bad_decode.add(decode.worker_id)


def _chunk(response: decode_pb2.DecodeResponse) -> GenerateChunk:
    if response.HasField("error"):
        raise error_from_code(response.error.code, response.error.message)
    finish = convert.finish_from_pb(response.finish_reason)
    return GenerateChunk(
        token_ids=list(response.token_ids),
        logprobs=[convert.logprob_from_pb(lp) for lp in response.logprobs]
        if response.logprobs
        else [],
        finish_reason=finish.value if finish else None,
        prompt_tokens=response.usage.prompt_tokens,
        cached_tokens=response.usage.cached_tokens,
    )
