"""`kvmesh bench serve`'s streaming client against a real mesh (1 prefill, 1 decode): a smoke
test of the measurement, not of the figures."""

from __future__ import annotations

import os

import pytest

from kvmesh.mesh.launcher import Mesh, UpOptions
from kvmesh.mesh.up_config import worker_configs
from kvmesh_apps.benchmarks.serve import measure_level
from kvmesh_apps.benchmarks.serve_client import Target
from kvmesh_apps.benchmarks.serve_paired import MIN_ROUNDS, measure_paired
from kvmesh_apps.benchmarks.serve_suite import measure_single_stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_client_measures_ttft_tpot_and_tokens():
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    mesh = Mesh(UpOptions(workers=worker_configs("--kv-cache-mib", "64"), prefill=1, decode=1))
    try:
        mesh.start()
        url = f"http://127.0.0.1:{mesh.http_port}"
        result = measure_level(url, "smollm2-135m", concurrency=1, n_requests=2, max_tokens=8)
        engine, paired = measure_paired(Target(url, "smollm2-135m"), "fp32", [1, 2], 2, 6)
        probed: list[float] = []
        single = measure_single_stream(
            Target(url, "smollm2-135m"),
            2,
            6,
            probe=lambda: probed.append(10.0 + len(probed)) or probed[-1],
        )
    finally:
        mesh.stop()
    assert all(proc.poll() is not None for proc in mesh.procs.values())
    assert result["num_requests"] == 2
    assert [r["tokens"] for r in result["requests"]] == [8, 8]
    assert all(r["ttft_s"] > 0 and r["tpot_s"] > 0 for r in result["requests"])
    assert result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] > 0
    assert result["output_tok_s"] > 0
    # the ceiling probe before the first single-stream request and after each one
    assert single["ceilings_gbs"] == [10.0, 11.0, 12.0]
    assert len(single["request_tok_s"]) == 2 and all(r > 0 for r in single["request_tok_s"])
    # engine and mesh, request by request: the same rounds of the same prompts on both
    assert sorted(engine) == sorted(paired) == [1, 2]
    for c, want in ((1, MIN_ROUNDS), (2, 2 * MIN_ROUNDS)):
        assert engine[c]["num_requests"] == paired[c]["num_requests"] == want
        assert engine[c]["inexact_requests"] == paired[c]["inexact_requests"] == 0
        assert engine[c]["tpot_p50_ms"] > 0 and paired[c]["tpot_p50_ms"] > 0
