"""`kvmesh bench serve`'s bounds: what each figure is divided by (measure_bounds)."""

from __future__ import annotations

import pytest

from kvmesh.benchmarks.serve_bounds import measure_bounds


def test_bounds_divide_single_stream_by_bandwidth_and_levels_by_gemm_speed():
    suite = {"single_stream": {"decode_tok_s": 30.0},
             "levels": [{"concurrency": 16, "output_tok_s": 300.0}]}  # fmt: skip
    bounds = measure_bounds(suite, "smollm2-135m", "bf16", "auto", before=10.0)
    band, compute = bounds["bandwidth"], bounds["compute"]
    nbytes = band["weight_bytes"]
    assert 250e6 < nbytes < 280e6  # SmolLM2-135M in bf16, its tied table once
    assert band["bound_tok_s"] == pytest.approx(sum(band["ceiling_gbs"]) / 2 * 1e9 / nbytes, 1e-3)
    assert band["of_bound"] == pytest.approx(30.0 / band["bound_tok_s"], 1e-2)
    # 2 FLOPs per bf16 weight element
    want = compute["gemm_gflops"] * 1e9 / (2 * nbytes / 2)
    assert compute["bound_tok_s"] == pytest.approx(want, 1e-3)
    assert compute["of_bound"] == {"16": pytest.approx(300.0 / compute["bound_tok_s"], 1e-2)}


def test_no_compute_bound_for_int4_weights():
    suite = {"single_stream": None, "levels": [{"concurrency": 16, "output_tok_s": 300.0}]}
    bounds = measure_bounds(suite, "smollm2-135m", "bf16", "int4", before=10.0)
    assert bounds == {"bandwidth": None, "compute": None}
