"""A proposer that drafts with a remote draft service (`--draft remote`).

It runs on the decode engine thread: committed target features are buffered per request and
sent with the next step's Propose call, one blocking gRPC call per step for the whole batch.
If the service fails, the step simply runs without drafts (speculation never changes output).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import grpc
import structlog
import torch

from kvmesh.engine.core.sequence import Sequence
from kvmesh.mesh import convert, tls
from kvmesh.mesh.grpc_server import CHANNEL_OPTIONS
from kvmesh.proto.v1 import draft_pb2, draft_pb2_grpc

log = structlog.get_logger(__name__)
ROUND_TRIPS_KEPT = 4096


class RemoteProposer:
    """The mesh's draft service as the engine's proposer (a decode worker's: it hands over
    nothing and holds nothing past a finish)."""

    reads_features = True

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        files = tls.current()
        self._channel = (
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            if files is None
            else grpc.secure_channel(address, files.channel_credentials(), options=CHANNEL_OPTIONS)
        )
        self._stub = draft_pb2_grpc.DraftStub(self._channel)
        self._pending: dict[str, list[draft_pb2.FeatureRows]] = {}  # sent with the next call
        # Seconds per Propose call, the latest ROUND_TRIPS_KEPT (bench: the remote cost).
        self.round_trips: deque[float] = deque(maxlen=ROUND_TRIPS_KEPT)

    def check_target(self, model_name: str) -> tuple[int, ...]:
        """The target layers the service's head reads; it must draft for `model_name`."""
        from kvmesh.errors import ModelFormatError

        info = self._stub.GetInfo(draft_pb2.GetDraftInfoRequest(), timeout=30)
        if info.target != model_name:
            raise ModelFormatError(
                f"draft service {self.address} drafts for {info.target!r}, not {model_name!r}"
            )
        return tuple(info.capture_layers)

    def observe(
        self, seq_id: str, features: torch.Tensor, next_tokens: list[int], start: int
    ) -> None:
        self._add(seq_id, features, next_tokens, start, fused=False)

    def seed(self, seq_id: str, fused: torch.Tensor, start: int, next_tokens: list[int]) -> None:
        self._pending.pop(seq_id, None)
        self._add(seq_id, fused, next_tokens, start, fused=True)

    def _add(self, seq_id, rows: torch.Tensor, next_tokens, start, fused: bool) -> None:
        self._pending.setdefault(seq_id, []).append(
            convert.feature_rows_to_pb(rows, start, next_tokens, fused)
        )

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.propose_batch([(seq, limit)])[0]

    def hand_over(self, seq_id: str) -> tuple[torch.Tensor, int] | None:
        return None

    def hold(self, seq_id: str) -> None:
        return None

    def propose_batch(self, requests: Seq[tuple[Sequence, int]]) -> list[list[int]]:
        wanted = {seq.seq_id: limit for seq, limit in requests}
        ids = list(dict.fromkeys([*self._pending, *wanted]))
        if not ids:
            return []
        inputs = []
        for seq_id in ids:  # the service applies inputs in order; drafts come with the last
            rows = self._pending.get(seq_id) or [None]
            inputs += [draft_pb2.DraftInput(request_id=seq_id, committed=r) for r in rows[:-1]]
            inputs.append(
                draft_pb2.DraftInput(
                    request_id=seq_id, committed=rows[-1], num_draft_tokens=wanted.get(seq_id, 0)
                )
            )
        self._pending.clear()
        started = time.perf_counter()
        try:
            reply = self._stub.Propose(
                draft_pb2.ProposeRequest(inputs=inputs), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            log.warning("draft.remote_failed", address=self.address, error=str(exc.code()))
            return [[] for _ in requests]
        self.round_trips.append(time.perf_counter() - started)
        drafts = {out.request_id: list(out.draft_token_ids) for out in reply.outputs}
        return [drafts.get(seq.seq_id, []) for seq, _ in requests]

    def release(self, seq_ids: Iterable[str], force: bool = False) -> None:
        ids = list(seq_ids)
        for seq_id in ids:
            self._pending.pop(seq_id, None)
        if not ids:
            return
        try:
            self._stub.Release(
                draft_pb2.ReleaseDraftRequest(request_ids=ids), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            log.warning("draft.release_failed", address=self.address, error=str(exc.code()))

    def close(self) -> None:
        self._channel.close()
