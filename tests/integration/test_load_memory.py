"""Peak RSS while a model loads -- the engine's path: load_model, then build_model -- stays
within its resident weights + 25 % + a fixed 32 MiB: the loader reads, converts and hands over
one tensor at a time and keeps none. Each load runs in a fresh process (load_memory_probe), as
ru_maxrss is a lifetime peak; the baseline is that process's RSS once torch and the loader are
imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
BOUND = 1.25  # peak - baseline <= BOUND * the model's weight_bytes + FIXED
FIXED = 32 << 20  # what a process pays once, whatever the model's size: torch's first ops
# (thread pools, allocator arenas), RoPE tables. SmolLM2 INT4 (117 MiB of weights) kept
# 15 MiB beyond its weights on Intel Xeon and 28 MiB on a CI machine (1.26 x and 1.36 x
# without FIXED); a loader that kept a copy of what it read would pass neither bound.
MiB = 1 << 20


def probe(*args: str, **env: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "tests.integration.load_memory_probe", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]) if args[0] == "load" else {}


def assert_within_bound(report: dict) -> None:
    grown, weights = report["peak"] - report["baseline"], report["weight_bytes"]
    assert grown <= BOUND * weights + FIXED, (
        f"peak RSS {grown / MiB:.0f} MiB above the baseline for {weights / MiB:.0f} MiB of "
        f"weights ({grown / weights:.2f} x, bound {BOUND} x + {FIXED / MiB:.0f} MiB): {report}"
    )


@pytest.fixture(scope="module")
def gguf(default_model_source) -> str:
    return str(default_model_source.gguf_file)


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("home"))


def test_smollm2_fp32_without_the_cache(gguf: str) -> None:
    report = probe("load", gguf, "--weights", "fp32", KVMESH_MODEL_CACHE="0")
    assert report["cache"] == "off"
    assert_within_bound(report)


def test_smollm2_fp32_cache_miss_then_hit(gguf: str, cache_home: str) -> None:
    env = {"KVMESH_HOME": cache_home, "KVMESH_MODEL_CACHE": "1"}
    miss = probe("load", gguf, "--weights", "fp32", **env)
    hit = probe("load", gguf, "--weights", "fp32", **env)
    assert (miss["cache"], hit["cache"]) == ("miss", "hit")
    assert_within_bound(miss)
    assert_within_bound(hit)


def test_smollm2_int4_cache_hit(gguf: str, cache_home: str) -> None:
    env = {"KVMESH_HOME": cache_home, "KVMESH_MODEL_CACHE": "1"}
    probe("load", gguf, "--weights", "int4", **env)
    hit = probe("load", gguf, "--weights", "int4", **env)
    assert hit["cache"] == "hit"
    assert_within_bound(hit)


@pytest.fixture(scope="module")
def llama_1gb(tmp_path_factory) -> str:
    """A ~0.94 GB float32 Llama in 4 safetensors shards, written by another process."""
    folder = tmp_path_factory.mktemp("llama") / "llama-1gb"
    probe("make-llama", str(folder))
    return str(folder)


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_a_1gb_sharded_safetensors_llama(llama_1gb: str, weights: str) -> None:
    """fp32: the model holds exactly the tensors the loader read (or their fused copies);
    bf16: it casts each as it goes."""
    report = probe("load", llama_1gb, "--weights", weights)
    assert report["weight_bytes"] >= {"fp32": 890, "bf16": 445}[weights] * MiB
    assert_within_bound(report)
