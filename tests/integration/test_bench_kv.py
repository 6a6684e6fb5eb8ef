"""`kvmesh bench kv --quick` end to end: three tables, sane numbers, a JSON report."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from kvmesh_apps.benchmarks.kv import add_arguments, markdown, run_kv_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def one_thread(monkeypatch):
    """One torch thread: 2-thread runs stall when another process takes a core of a 2-core box
    (45 s quiet, over 4 min shared); restored afterwards, as engines set it process-wide."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("KVMESH_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def test_quick_kv_bench_writes_three_sane_tables(tmp_path, capsys, one_thread):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "kv.json"
    assert run_kv_bench(parser.parse_args(["--quick", "--output", str(out)])) == 0
    report = json.loads(out.read_text())
    for key in ("date", "machine", "command", "kv_budget_bytes"):
        assert report[key]

    throughput = report["throughput"]
    assert [(r["concurrency"], r["kv_dtype"]) for r in throughput] == [
        (c, kv) for c in (1, 2) for kv in ("bf16", "fp8_e4m3")
    ]
    capacity = {r["kv_dtype"]: r["capacity_tokens"] for r in throughput}
    assert capacity["fp8_e4m3"] / capacity["bf16"] > 1.9
    for r in throughput:
        assert r["kv_bytes"] <= report["kv_budget_bytes"]
        assert r["tok_s"] > 0 and 1 <= r["max_running"] <= r["concurrency"]
        assert (r["fp8_over_bf16"] is None) == (r["kv_dtype"] == "bf16")

    integrity = report["integrity"]
    assert [r["concurrency"] for r in integrity] == [1, 2]
    for r in integrity:
        assert r["off_tok_s"] > 0 and r["on_tok_s"] > 0
        assert r["check_us_per_step"] > 0 and 0 < r["check_fraction"] < 0.05

    quality = {r["kv_dtype"]: r for r in report["quality"]}
    assert list(quality) == ["fp32", "bf16", "fp8_e4m3"]
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in quality.values())
    assert quality["fp32"]["greedy_prefix"] == [8, 8] and quality["fp32"]["ppl_vs_fp32"] == 0
    assert abs(quality["fp8_e4m3"]["perplexity"] / quality["fp32"]["perplexity"] - 1) < 0.05
    assert all(0 <= n <= 8 for r in quality.values() for n in r["greedy_prefix"])

    printed = capsys.readouterr().out
    assert markdown(report) in printed
    assert sum(line.startswith("| ---") for line in printed.splitlines()) == 3
