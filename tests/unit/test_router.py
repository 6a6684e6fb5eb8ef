"""Routing v1: token-aware least load, exclusions, and in-flight accounting."""

from __future__ import annotations

import pytest

from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.routing.router import Router, WorkerUnavailable


def _workers(role: str, n: int) -> list[WorkerInfo]:
    return [
        WorkerInfo(role=role, worker_id=f"{role}-{i}", grpc_address=f"127.0.0.1:{9000 + i}")
        for i in range(n)
    ]


def test_least_tokens_spreads_by_tokens_not_requests():
    router = Router(lambda role: _workers(role, 3))
    chosen = []
    with router.holding("decode-0", 1000), router.holding("decode-1", 10):
        chosen.append(router.pick("decode", 50).worker.worker_id)  # decode-2 has 0
        with router.holding("decode-2", 500):
            chosen.append(router.pick("decode", 50).worker.worker_id)  # decode-1 has 10
    assert chosen == ["decode-2", "decode-1"]
    assert router.pick("decode", 50).worker.worker_id == "decode-0"  # all released: tie -> id order


def test_exclusions_and_no_worker():
    router = Router(lambda role: _workers(role, 2))
    assert router.pick("prefill", 10, exclude={"prefill-0"}).worker.worker_id == "prefill-1"
    with pytest.raises(WorkerUnavailable, match="no live prefill"):
        router.pick("prefill", 10, exclude={"prefill-0", "prefill-1"})


def test_reported_load_counts_when_higher_than_local_estimate():
    router = Router(lambda role: _workers(role, 2))
    router._reported["decode-0"] = 5000  # another gateway's requests  # noqa: SLF001
    assert router.pick("decode", 10).worker.worker_id == "decode-1"
    assert router.pick("decode", 10).reason == "least_tokens"


def _candidates(loads: dict[str, int]):
    from kvmesh.routing.router import Candidate

    return [
        Candidate(WorkerInfo(role="decode", worker_id=w, grpc_address="127.0.0.1:1"), load)
        for w, load in loads.items()
    ]


def test_affinity_keeps_the_pinned_worker_until_it_is_far_above_the_least_loaded():
    from kvmesh.routing.router import AffinityPolicy

    policy = AffinityPolicy(max_load_ratio=2.0, slack_tokens=100)
    kept = policy.choose("decode", _candidates({"a": 300, "b": 200}), 10, "a")
    assert (kept.worker.worker_id, kept.reason) == ("a", "affinity")
    yielded = policy.choose("decode", _candidates({"a": 501, "b": 200}), 10, "a")
    assert (yielded.worker.worker_id, yielded.reason) == ("b", "affinity_yield_load")
    gone = policy.choose("decode", _candidates({"b": 200}), 10, "a")
    assert (gone.worker.worker_id, gone.reason) == ("b", "affinity_worker_gone")
    plain = policy.choose("decode", _candidates({"a": 5, "b": 1}), 10, None)
    assert (plain.worker.worker_id, plain.reason) == ("b", "least_tokens")


def test_prefill_is_only_paired_with_a_decode_of_the_same_page_layout():
    def live(role: str) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                role=role,
                worker_id=f"{role}-{dtype}",
                grpc_address="127.0.0.1:1",
                model="m",
                page_size=16,
                kv_dtype=dtype,
            )
            for dtype in ("bf16", "fp8_e4m3")
        ]

    router = Router(live)
    fp8_decode = live("decode")[1]
    with router.holding("prefill-bf16", 0), router.holding("prefill-fp8_e4m3", 10_000):
        assert router.pick("prefill", 10).worker.worker_id == "prefill-bf16"  # least loaded
        paired = router.pick("prefill", 10, paired_with=fp8_decode).worker
    assert paired.worker_id == "prefill-fp8_e4m3"  # busier, but the only compatible one
    other_model = WorkerInfo(
        role="decode",
        worker_id="d",
        grpc_address="127.0.0.1:1",
        model="other",
        page_size=16,
        kv_dtype="fp8_e4m3",
    )
    with pytest.raises(WorkerUnavailable):
        router.pick("prefill", 10, paired_with=other_model)
