"""`kvmesh bench parallel` at its smallest: a row per rank count, memory for every rank, sane
numbers (speeds are recorded in docs/benchmarks.md, never asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh.benchmarks.parallel import add_arguments, run_parallel_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_small_parallel_bench_reports_each_rank(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "parallel.json"
    args = parser.parse_args(["--concurrency", "1", "--max-tokens", "4", "--output", str(out)])
    assert run_parallel_bench(args) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["tensor_parallel"] for r in runs] == [1, 2]
    assert [len(r["rssanon_mib_per_rank"]) for r in runs] == [1, 2]
    one, two = runs
    assert two["rank0_weight_mib"] < one["rank0_weight_mib"]
    assert all(r["tok_s_1"] > 0 and r["tokens_equal_first"] for r in runs)
