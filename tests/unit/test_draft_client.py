"""RemoteProposer keeps bounded state however long a worker runs."""

from __future__ import annotations

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.mesh import draft_client
from kvmesh.mesh.draft_client import RemoteProposer
from kvmesh.proto.v1 import draft_pb2


class _Stub:
    def Propose(self, request, timeout):  # noqa: N802 (gRPC method name)
        return draft_pb2.ProposeResponse(
            outputs=[
                draft_pb2.DraftOutput(request_id=i.request_id, draft_token_ids=[7, 8])
                for i in request.inputs
                if i.num_draft_tokens
            ]
        )


def test_round_trip_history_is_bounded():
    proposer = RemoteProposer("127.0.0.1:1")  # never dialled: the stub answers
    proposer._stub = _Stub()
    seq = Sequence("s", [1, 2, 3], SamplingParams())
    try:
        for _ in range(draft_client.ROUND_TRIPS_KEPT + 10):
            assert proposer.propose(seq, 2) == [7, 8]
    finally:
        proposer.close()
    assert len(proposer.round_trips) == draft_client.ROUND_TRIPS_KEPT
