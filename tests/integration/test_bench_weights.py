"""`kvmesh bench weights --quick` end to end, and the in-process hand-over its quality table
rests on: KV pages computed by one engine and copied into another's pool continue exactly as
in one engine (and do not without the copy)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.core.engine import Engine
from kvmesh_apps.benchmarks import weights_quality
from kvmesh_apps.benchmarks.weights import add_arguments, run_weights_bench
from kvmesh_apps.benchmarks.weights_quality import split_greedy, split_logits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_quick_weights_bench_writes_memory_speed_and_quality(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_NUM_THREADS", "1")  # engines set it process-wide: restore below
    threads = torch.get_num_threads()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "weights.json"
    args = ["--quick", "--configs", "bf16,int4", "--kv-cache-bytes", str(32 << 20)]
    try:
        assert run_weights_bench(parser.parse_args([*args, "--output", str(out)])) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    memory = {r["config"]: r for r in report["memory"]}
    assert memory["bf16"]["vs_bf16"] == 1.0 and 0.4 < memory["int4"]["vs_bf16"] < 0.5
    assert [(r["config"], r["concurrency"]) for r in report["speed"]] == [
        (name, c) for c in (0, 1, 2) for name in ("bf16", "int4")
    ]  # 0: the prefill of one long prompt (--prefill-tokens)
    assert all(r["decode_tok_s"] > 0 for r in report["speed"])
    pairs = [(r["prefill"], r["decode"]) for r in report["quality"]]
    assert pairs == [("bf16", "bf16"), ("bf16", "int4"), ("int4", "int4")]
    for row in report["quality"]:
        assert 1 < row["perplexity"] < 100 and len(row["greedy_prefix"]) == 6


def test_handed_over_pages_continue_as_in_one_engine(llm, monkeypatch):
    a, b = llm.engine, Engine(EngineConfig.of(model="smollm2-135m", kv_cache_bytes=64 << 20))
    ids = llm.tokenizer.encode("The lighthouse keeper climbed the stairs every night, and")
    ids += ids[:8]
    want = split_logits(a, a, ids, 10)  # summation order differs: a chunk vs the whole text
    torch.testing.assert_close(split_logits(a, b, ids, 10), want, atol=1e-3, rtol=0)
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": q}])
        for q in ("Name three rivers.", "What is a prime number?")
    ]
    assert split_greedy(a, b, prompts, 16) == split_greedy(a, a, prompts, 16)
    b.block_manager.reset_prefix_cache()  # no cached pages, no stale KV from the run above
    b.kv_cache.pool.zero_()
    monkeypatch.setattr(weights_quality, "_copy_pages", lambda *_: None)  # no KV arrives
    assert split_greedy(a, b, prompts, 16) != split_greedy(a, a, prompts, 16)
