"""`kvmesh bench serve`'s bounds: what each figure is divided by (measure_bounds)."""

from __future__ import annotations

import pytest

from kvmesh_apps.benchmarks.serve_bounds import measure_bounds


def test_bounds_divide_single_stream_by_bandwidth_and_levels_by_gemm_speed():
    """Each single-stream request against the mean of the ceilings measured before and after
    it; the median of those ratios."""
    single = {
        "decode_tok_s": 30.0,
        "request_tok_s": [30.0, 60.0, 40.0],
        "ceilings_gbs": [10.0, 10.0, 30.0, 10.0],
    }
    suite = {"single_stream": single, "levels": [{"concurrency": 16, "output_tok_s": 300.0}]}
    bounds = measure_bounds(suite, "smollm2-135m", "bf16", "auto", gemm_gflops=lambda: 61.25)
    band, compute = bounds["bandwidth"], bounds["compute"]
    nbytes = band["weight_bytes"]
    assert 250e6 < nbytes < 280e6  # SmolLM2-135M in bf16, its tied table once
    per_gbs = 1e9 / nbytes  # tok/s per GB/s
    want = [30.0 / (10 * per_gbs), 60.0 / (20 * per_gbs), 40.0 / (20 * per_gbs)]
    assert band["of_bound_per_request"] == pytest.approx(want, 1e-2)
    assert band["of_bound"] == pytest.approx(sorted(want)[1], 1e-2)
    assert band["bound_tok_s"] == pytest.approx(20 * per_gbs, 1e-3)
    # 2 FLOPs per bf16 weight element; a fixed GEMM figure: the test never depends on the
    # machine's speed (a slow bf16 GEMM made the rounding alone exceed a tolerance on AVX2)
    assert compute["gemm_gflops"] == 61.2
    want = 61.25e9 / (2 * nbytes / 2)
    assert compute["bound_tok_s"] == pytest.approx(want, abs=0.051)
    assert compute["of_bound"] == {"16": pytest.approx(300.0 / compute["bound_tok_s"], 1e-2)}


def test_no_compute_bound_for_int4_weights():
    suite = {"single_stream": None, "levels": [{"concurrency": 16, "output_tok_s": 300.0}]}
    bounds = measure_bounds(suite, "smollm2-135m", "bf16", "int4")
    assert bounds == {"bandwidth": None, "compute": None}
