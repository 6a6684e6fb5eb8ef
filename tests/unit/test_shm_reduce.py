"""The shared-memory all-reduce of tensor-parallel ranks: two processes sum many tensors of
changing sizes to the same exact bits; a rank whose peer is gone fails instead of waiting."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from kvmesh.engine.parallel import shm_reduce
from kvmesh.engine.parallel.shm_reduce import ShmAllReduce
from kvmesh.errors import EngineFailure

CALLS = 200


def _part(call: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(call * 10 + rank)
    return torch.randn(1 + call % 37 * 13, generator=gen)


def _expected(call: int) -> torch.Tensor:
    return _part(call, 0) + _part(call, 1)


def _rank1(name: str, out) -> None:
    reduce = ShmAllReduce(2, 1, 512, name)
    ok = True
    for call in range(CALLS):
        tensor = _part(call, 1)
        reduce(tensor)
        ok &= torch.equal(tensor, _expected(call))
    reduce.close()
    out.put(ok)


def test_two_processes_sum_to_the_same_bits():
    reduce = ShmAllReduce(2, 0, 512)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_rank1, args=(reduce.name, out))
    child.start()
    try:
        for call in range(CALLS):
            tensor = _part(call, 0)
            reduce(tensor)
            assert torch.equal(tensor, _expected(call)), call  # rank 0 first: x0 + x1, in order
        assert out.get(timeout=30)
        child.join(30)
    finally:
        child.kill()
        reduce.close()


def test_a_rank_whose_peer_is_gone_raises(monkeypatch):
    monkeypatch.setattr(shm_reduce, "CHECK_EVERY_S", 0.01)
    reduce = ShmAllReduce(2, 0, 16, alive=lambda: False)
    try:
        with pytest.raises(EngineFailure, match="rank of this engine is gone"):
            reduce(torch.ones(4))
    finally:
        reduce.close()
