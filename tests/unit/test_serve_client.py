"""`kvmesh bench serve`'s client pieces that need no server: what a request asks for (exact
lengths on every server kind), how a stream's tokens are counted (usage chunk, else content
deltas) and when a length is reported inexact, URLs, the long prompt and the level summary."""

from __future__ import annotations

from kvmesh_apps.benchmarks.serve_client import (
    RequestTiming,
    Streamed,
    Target,
    request_body,
    root_url,
)
from kvmesh_apps.benchmarks.serve_suite import long_prompt, summarize


def test_a_request_asks_for_an_exact_greedy_length_and_the_usage_chunk() -> None:
    body = request_body(Target("http://h:1", "m"), "hi", 8)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (8, 8, True)
    assert body["temperature"] == 0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_completions_and_strict_servers() -> None:
    body = request_body(Target("http://h:1", "m", api="completions", min_tokens=False), "hi", 4)
    assert body["prompt"] == "hi" and "messages" not in body and "min_tokens" not in body
    assert request_body(Target("http://h:1", "m"), "hi", 4, stream=False).get("stream") is None
    assert Target("http://h:1", "m", api_key="k").headers == {"Authorization": "Bearer k"}


def test_root_url_drops_the_v1_suffix() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert root_url(url) == "http://h:8000"
    assert Target("http://h:8000/v1/", "m").url == "http://h:8000"


def test_tokens_come_from_usage_when_sent() -> None:
    streamed = Streamed((0.5, 0.6, 0.7), usage_tokens=4, prompt_tokens=20, max_tokens=4)
    timing = streamed.timing()
    assert (timing.tokens, timing.counted_by, timing.exact) == (4, "usage", True)
    assert abs(timing.ttft_s - 0.5) < 1e-9 and abs(timing.tpot_s - 0.2 / 3) < 1e-9
    assert [round(g, 3) for g in streamed.gaps] == [0.1, 0.1]


def test_without_usage_deltas_are_counted_and_a_short_stream_is_inexact() -> None:
    timing = Streamed((0.1, 0.2, 0.3), None, None, max_tokens=3).timing()
    assert (timing.tokens, timing.counted_by, timing.exact) == (3, "deltas", True)
    short = Streamed((0.1, 0.2), None, None, max_tokens=3).timing()
    assert (short.tokens, short.exact) == (2, False)
    assert Streamed((0.1,), 1, None, max_tokens=1).timing().tpot_s is None


def test_long_prompts_are_distinct_from_their_first_token() -> None:
    a, b = long_prompt("run-0", 30), long_prompt("run-1", 30)
    assert a.split("\n")[1:] == b.split("\n")[1:] and a.split()[1] != b.split()[1]
    assert len(long_prompt("x", 20).splitlines()) == 21


def test_a_level_summary_flags_inexact_lengths() -> None:
    timings = [RequestTiming(0.1, 0.01, 8), RequestTiming(0.3, 0.02, 5, None, "deltas", False)]
    row = summarize("server", 2, timings, wall_s=1.0)
    assert (row["num_requests"], row["output_tok_s"]) == (2, 13.0)
    assert row["lengths_exact"] is False and row["inexact_requests"] == 1
    assert row["counted_by"] == ["deltas", "usage"]
    assert row["ttft_p50_ms"] == 200.0 and row["tpot_p90_ms"] == 19.0
