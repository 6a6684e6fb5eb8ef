"""`kvmesh bench parallel` at its smallest: a row per layout (SmolLM2 on 1 and 2 ranks, a tiny
DeepSeek-V3 on 1 rank, with its experts over 2 and in 2 pipeline stages), memory for every rank, sane numbers (speeds are recorded in docs/benchmarks.md, never asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh_apps.benchmarks.parallel import add_arguments, run_parallel_bench
from kvmesh_apps.tools.tiny_configs import TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_small_parallel_bench_reports_each_rank(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "parallel.json"
    moe = make_tiny_model(TinySpec("deepseek_v3"), tmp_path / "moe").path
    args = parser.parse_args(
        [
            "--concurrency",
            "1",
            "--max-tokens",
            "4",
            "--output",
            str(out),
            "--tensor-parallel",
            "1,2",
            "--moe-layouts",
            "1,ep2,pp2",
            "--moe-model",
            str(moe),
        ]
    )
    assert run_parallel_bench(args) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["tensor_parallel"], r["pipeline_parallel"], r["expert_parallel"]) for r in runs] == [
        (1, 1, False),
        (2, 1, False),
        (1, 1, False),
        (2, 1, True),
        (1, 2, False),
    ]
    assert [len(r["rssanon_mib_per_rank"]) for r in runs] == [1, 2, 1, 2, 2]
    for one, split in ((runs[0], runs[1]), (runs[2], runs[3]), (runs[2], runs[4])):
        assert split["rank0_weight_mib"] < one["rank0_weight_mib"]
    assert all(r["tok_s_1"] > 0 and r["tokens_equal_first"] for r in runs)
