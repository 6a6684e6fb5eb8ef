"""GenerateBackend over the mesh: route, call Decode.Generate (which pulls in a prefill worker),
its chunks but the last coming on the worker's delivery stream (delivery.py), retry on another
worker when one is gone before the first token, abort down the chain."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from kvmesh.errors import PrefillUnavailable
from kvmesh.mesh import convert
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.error_mapping import error_from_code, error_from_grpc
from kvmesh.mesh.grpc_server import channel
from kvmesh.proto.v1 import decode_pb2, decode_pb2_grpc
from services.gateway.backend import GenerateChunk, GenerateInput
from services.gateway.delivery import Delivery
from services.gateway.prefix_routing import PromptKey
from services.gateway.router import Router, WorkerUnavailable
from services.gateway.sessions import Pin, SessionStore

log = structlog.get_logger(__name__)
MAX_ATTEMPTS = 3
REFUSED_RETRY_S = 5.0  # a delivery socket that refused a connection is tried again after this
_now = time.monotonic


class MeshBackend:
    def __init__(
        self,
        router: Router,
        model_name: str,
        max_model_len: int,
        sessions: SessionStore | None = None,
    ) -> None:
        self.router = router
        self.sessions = sessions
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._where: dict[str, str] = {}  # request id -> decode address
        self._deliveries: dict[str, Delivery] = {}  # delivery socket -> its open stream
        self._refused: dict[str, float] = {}  # delivery socket -> when to try it again

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        pin = await self._lookup(request.session_id)
        prompt = PromptKey(self.model_name, request.prompt_token_ids, request.cache_salt)
        bad_decode: set[str] = set()
        bad_prefill: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            cost = self._decode_cost(request)
            decode = self.router.pick("decode", cost, bad_decode, pin and pin.decode, prompt).worker
            prefill = self._pick_prefill(request, decode, bad_prefill, pin and pin.prefill, prompt)
            started = False
            try:
                async for chunk in self._stream(request, decode, prefill, prompt):
                    if not started and request.session_id and self.sessions:
                        pinned = Pin(prefill.worker_id if prefill else "", decode.worker_id)
                        await self.sessions.pin(request.session_id, pinned)
                    started = True
                    yield chunk
                return
            except WorkerUnavailable as exc:
                if started or attempt == MAX_ATTEMPTS - 1:
                    raise
                log.warning("gateway.retry", decode=decode.worker_id, error=str(exc))
                if isinstance(exc, PrefillUnavailable) and prefill is not None:
                    bad_prefill.add(prefill.worker_id)
                else:
                    bad_decode.add(decode.worker_id)

    async def _lookup(self, session_id: str | None) -> Pin | None:
        if not session_id or self.sessions is None:
            return None
        return await self.sessions.lookup(session_id)

    def _pick_prefill(self, request: GenerateInput, decode: WorkerInfo, exclude: set[str],
                      preferred: str | None, prompt: PromptKey) -> WorkerInfo | None:  # fmt: skip
        """A prefill worker whose pages `decode` can take; None: decode prefills it itself."""
        try:
            cost = len(request.prompt_token_ids)
            return self.router.pick(
                "prefill", cost, exclude, preferred or None, prompt, paired_with=decode
            ).worker
        except WorkerUnavailable:
            return None

    @staticmethod
    def _decode_cost(request: GenerateInput) -> int:
        return len(request.prompt_token_ids) + request.params.max_tokens

    async def _stream(
        self, request: GenerateInput, decode: WorkerInfo, prefill: WorkerInfo | None,
        prompt: PromptKey,
    ) -> AsyncIterator[GenerateChunk]:  # fmt: skip
        stub = decode_pb2_grpc.DecodeStub(self._channel(decode.grpc_address))
        message = decode_pb2.DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=convert.sampling_to_pb(request.params),
            prefill_address=prefill.grpc_address if prefill else "",
            cache_salt=request.cache_salt,
        )
        self._where[request.request_id] = decode.grpc_address
        held = self._decode_cost(request)
        delivery = self._delivery(decode.delivery_address)
        if delivery is not None and delivery.serves(request.request_id):
            delivery = None  # a request of this id runs there already: this one on its call
        if delivery is not None:
            message.delivery_id = delivery.id
        try:
            with self.router.holding(decode.worker_id, held), contextlib.ExitStack() as prefilling:
                prefilling.enter_context(self._holding_prefill(prefill, request))
                call = stub.Generate(message)
                responses = call if delivery is None else delivery.chunks(request.request_id, call)
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
                    if delivery is not None:
                        await responses.aclose()
                    call.cancel()  # no-op when finished; cancels decode when the client left
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise WorkerUnavailable(
                    f"decode worker {decode.worker_id} unavailable: {exc.details()}"
                ) from exc
            raise error_from_grpc(exc.code(), exc.details()) from exc
        finally:
            self._where.pop(request.request_id, None)

    def _holding_prefill(self, prefill: WorkerInfo | None, request: GenerateInput):
        if prefill is None:
            return contextlib.nullcontext()
        return self.router.holding(prefill.worker_id, len(request.prompt_token_ids))

    async def abort(self, request_id: str) -> None:
        address = self._where.get(request_id)
        if address is None:
            return
        stub = decode_pb2_grpc.DecodeStub(self._channel(address))
        try:
            await stub.Abort(decode_pb2.AbortRequest(request_id=request_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("gateway.abort_failed", request_id=request_id, code=exc.code().name)

    def _delivery(self, address: str) -> Delivery | None:
        """The open delivery stream to the delivery socket `address` (opened now if there is
        none: an ended one is forgotten as it ends); None where the worker advertises none or
        its socket refused the last try (then the chunks come on Generate)."""
        if not address or self._refused.get(address, 0.0) > _now():
            return None
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
