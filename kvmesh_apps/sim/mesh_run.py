"""The simulator's workloads sent to a live mesh: the gateway's gRPC Generate with token ids
(greedy, EOS ignored, `x-session-affinity` as session_id), timed as the simulator times them."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from kvmesh_apps.sim.gateway import Record
from kvmesh_apps.sim.workload import Session


class MeshClient:
    def __init__(self, address: str, timeout_s: float = 300.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self.t0 = time.perf_counter()

    async def __aenter__(self) -> MeshClient:
        self._channel = grpc.aio.insecure_channel(self.address)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        session_id: str | None = None,
        label: tuple[str, int] = ("", 0),
        first: asyncio.Event | None = None,
    ) -> tuple[Record, list[int]]:
        """One request: its record (times from this client's start) and the reply tokens;
        `first` is set when the first token came."""
        stub = gateway_pb2_grpc.GatewayStub(self._channel)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ),
            session_id=session_id or "",
        )
        record = Record(label[0], label[1], self.now(), len(prompt))
        reply: list[int] = []
        async for response in stub.Generate(request, timeout=self.timeout_s):
            if response.HasField("error"):
                record.error = response.error.message
                break
            if response.token_ids:
                record.token_times.extend([self.now()] * len(response.token_ids))
                reply.extend(response.token_ids)
                if first is not None:
                    first.set()
            if response.HasField("usage"):
                record.cached_tokens = response.usage.cached_tokens
        return record, reply


async def run_sessions(address: str, sessions: list[Session]) -> list[Record]:
    """Every session's turns in order, sessions concurrently from their start times."""
    records: list[Record] = []
    async with MeshClient(address) as client:

        async def one(session: Session) -> None:
            await asyncio.sleep(max(0.0, session.start_s - client.now()))
            while True:
                max_tokens = len(session.replies[session.turn])
                record, reply = await client.generate(
                    session.prompt(),
                    max_tokens,
                    session.affinity_id,
                    (session.session_id, session.turn + 1),
                )
                records.append(record)
                if record.error or not session.replied(reply):
                    return
                await asyncio.sleep(session.think_s)

        await asyncio.gather(*(one(s) for s in sessions))
    return records
