"""`kvmesh bench agent-api` end to end at its smallest: every section of the report present,
its numbers sane (the speeds themselves are recorded in docs/benchmarks.md, never asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh_apps.benchmarks.agent_api import add_arguments, run_agent_api_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_small_agent_api_bench_writes_every_section(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "agent.json"
    args = [
        "--concurrency",
        "1,2",
        "--max-tokens",
        "8",
        "--rounds",
        "1",
        "--eagle-prompts",
        "1",
        "--output",
        str(out),
    ]
    assert run_agent_api_bench(parser.parse_args(args)) == 0
    report = json.loads(out.read_text())
    assert [row["streams"] for row in report["grammar_cost"]] == [1, 2]
    for row in report["grammar_cost"]:
        assert row["plain_tok_s"] > 0 and row["grammar_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["grammar_tok_s"] / row["plain_tok_s"], abs=1e-3)
    ttft = report["ttft"]
    assert ttft["ttft_cold_ms"] > 0 and ttft["ttft_cached_ms"] > 0
    assert ttft["compile_cached_ms"] < ttft["compile_cold_ms"]  # the cache answers, no compile
    assert [row["method"] for row in report["eagle_json"]] == ["no grammar", "json_object grammar"]
    for row in report["eagle_json"]:
        assert row["tokens"] > 0 and row["drafted"] > 0 and 0 <= row["accepted_per_draft"] <= 1
