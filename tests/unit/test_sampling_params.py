"""SamplingParams accepts exactly what the wire format (common.proto) can carry."""

from __future__ import annotations

import pytest

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError
from kvmesh.mesh.convert import sampling_from_pb, sampling_to_pb


@pytest.mark.parametrize("seed", [0, -(2**63), 2**63 - 1])
def test_every_int64_seed_round_trips_through_the_proto(seed):
    params = SamplingParams(seed=seed, top_k=2**31 - 1, max_tokens=2**32 - 1)
    assert sampling_from_pb(sampling_to_pb(params)) == params


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("top_k", 2**31),
        ("max_tokens", 2**32),
        ("stop_token_ids", (2**32,)),
        ("stop_token_ids", (-1,)),
    ],
)
def test_an_integer_the_wire_cannot_carry_is_an_invalid_request_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})
