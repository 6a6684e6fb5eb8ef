"""`kvmesh bench pd` without a mesh: the workload's schedule and checks, which steady requests
the window measures, the percentiles and ratios of the report, the CPU placement of both modes
and the printed table."""

from __future__ import annotations

import pytest

from kvmesh.errors import ServeBenchError
from kvmesh_apps.benchmarks.pd import markdown, placements
from kvmesh_apps.benchmarks.pd_workload import PdRun, PdWorkload, ratios, summarize_run
from kvmesh_apps.benchmarks.serve_client import Streamed


def steady(sent_at: float, gap: float, tokens: int = 5) -> Streamed:
    arrivals = tuple(0.2 + i * gap for i in range(tokens))
    return Streamed(arrivals, tokens, 30, tokens, "length", sent_at)


def test_long_prompts_arrive_at_a_fixed_rate_after_the_streams_started() -> None:
    w = PdWorkload(long_prompts=3, interval_s=2.5, first_long_s=1.0)
    assert w.arrivals() == [1.0, 3.5, 6.0]
    with pytest.raises(ValueError):
        PdWorkload(streams=0)
    with pytest.raises(ValueError):
        PdWorkload(interval_s=0)


def test_only_steady_requests_overlapping_the_window_are_measured() -> None:
    before = steady(0.0, 0.1)  # done at 0.6
    during = steady(9.0, 0.1)
    straddling = steady(0.5, 0.1)  # 0.5 + 0.6 = 1.1 > window start
    after = steady(20.5, 0.1)
    run = PdRun([before, during, straddling, after], [], window=(1.0, 20.0))
    assert run.measured() == [during, straddling]


def test_the_summary_reads_tpot_itl_and_ttft_of_both_kinds() -> None:
    fast = [steady(2.0 + i, 0.1) for i in range(9)]
    stalled = steady(11.0, 1.0)  # one request with 1 s gaps
    long = [Streamed((1.5, 1.6), 2, 1500, 2, "length", 3.0), Streamed((2.5, 2.6), 2, 1490, 2)]
    s = summarize_run(PdRun([*fast, stalled], long, window=(1.0, 21.0)))
    assert s["steady_requests"] == 10 and s["long_requests"] == 2
    assert s["steady_tpot_p50_ms"] == 100.0 and s["steady_tpot_p90_ms"] == pytest.approx(190.0)
    assert s["steady_itl_p50_ms"] == 100.0 and s["steady_itl_p99_ms"] > 900
    assert s["steady_ttft_p50_ms"] == 200.0
    assert (s["long_ttft_p50_ms"], s["long_ttft_p90_ms"]) == (2000.0, 2400.0)
    assert s["long_prompt_tokens"] == [1490, 1500]
    assert s["steady_tok_s"] == 2.5 and s["window_s"] == 20.0  # 50 tokens in 20 s
    assert s["lengths_exact"] is True


def test_ratios_are_disaggregated_over_colocated() -> None:
    colocated = {"steady_tpot_p90_ms": 200.0, "long_ttft_p50_ms": 1000.0, "steady_requests": 9}
    disaggregated = {"steady_tpot_p90_ms": 80.0, "long_ttft_p50_ms": 1500.0, "steady_requests": 9}
    assert ratios(colocated, disaggregated) == {"steady_tpot_p90": 0.4, "long_ttft_p50": 1.5}
    assert ratios({"x_ms": None}, {"x_ms": 1.0}) == {"x": None}


def test_placements_split_the_cpus() -> None:
    two = placements(frozenset({0, 1}))
    assert (two["colocated"].prefill, two["colocated"].cpus) == (0, {"decode": "0-1"})
    assert two["disaggregated"].cpus == {"prefill": "0", "decode": "1"}
    assert placements(frozenset({2, 3, 4, 5}))["disaggregated"].cpus == {
        "prefill": "2-3",
        "decode": "4-5",
    }
    with pytest.raises(ServeBenchError, match="at least 2 CPUs"):
        placements(frozenset({0}))


def test_the_table_shows_both_modes_and_the_verdict() -> None:
    row = summarize_run(PdRun([steady(2.0, 0.1)], [steady(3.0, 0.1)], window=(1.0, 5.0)))
    modes = [
        {"mode": "colocated", "cpus": {"decode": "0-1"}, **row},
        {"mode": "disaggregated", "cpus": {"prefill": "0", "decode": "1"}, **row},
    ]
    report = {
        "date": "d",
        "machine": "m",
        "dtype": "fp32",
        "workload": vars(PdWorkload()),
        "modes": modes,
        "ratios": ratios(modes[0], modes[1]),
        "target_met": False,
    }
    text = markdown(report)
    assert "| colocated | decode 0-1 |" in text and "| prefill 0 decode 1 |" in text
    assert "p90 TPOT ratio 1.0 (target <= 0.5: missed)" in text
