"""The ids a worker was told to abort before it held them: remembered for a while, a bounded
number of them, the oldest forgotten first."""

from __future__ import annotations

import pytest

from kvmesh.mesh.aborted_ids import AbortedIds


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_id_is_remembered_for_its_ttl_then_forgotten():
    clock = _Clock()
    ids = AbortedIds(capacity=8, ttl_s=10.0, clock=clock)
    ids.add("a")
    clock.now += 5
    ids.add("b")
    assert "a" in ids and "b" in ids and "c" not in ids
    clock.now += 5  # a's ten seconds are up
    assert "a" not in ids and "b" in ids and len(ids) == 1
    clock.now += 5
    assert "b" not in ids and len(ids) == 0


def test_adding_an_id_again_starts_its_ttl_again():
    clock = _Clock()
    ids = AbortedIds(capacity=8, ttl_s=10.0, clock=clock)
    ids.add("a")
    ids.add("b")
    clock.now += 6
    ids.add("a")
    clock.now += 6
    assert "a" in ids and "b" not in ids


def test_past_its_capacity_the_oldest_ids_go_first():
    ids = AbortedIds(capacity=3, ttl_s=60.0, clock=_Clock())
    for request_id in "abcde":
        ids.add(request_id)
    assert [r for r in "abcde" if r in ids] == ["c", "d", "e"]
    assert len(ids) == 3


@pytest.mark.parametrize(("capacity", "ttl_s"), [(0, 1.0), (1, 0.0), (4, -1.0)])
def test_a_bound_that_holds_nothing_is_refused(capacity, ttl_s):
    with pytest.raises(ValueError, match="capacity"):
        AbortedIds(capacity, ttl_s)
