"""The converted-model cache on tiny GGUF files: hits equal the uncached conversion bit for bit,
a changed source misses (and its stale entry goes), a torn entry is rebuilt, INT4 round-trips,
and processes populating or rewriting one entry at once never leave a partial file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader import load_model, load_weights, model_cache, read_config, resolve_model
from kvmesh.engine.quant.int4 import Int4Weight
from tests.unit.tiny_checkpoints import tiny_hf_weights, write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVMESH_MODEL_CACHE", raising=False)
    return tmp_path / "home"


def tiny_gguf(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    write_tiny_gguf(
        path,
        {
            n: rng.standard_normal(a.shape).astype(np.float32)
            for n, a in tiny_hf_weights(True).items()
        },
    )
    return path


def entries(home: Path) -> list[Path]:
    return sorted(home.glob("cache/models/*/*.safetensors"))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_hit_is_the_uncached_conversion_bit_for_bit(home: Path, tmp_path: Path, dtype) -> None:
    source = resolve_model(str(tiny_gguf(tmp_path / "tiny.gguf")))
    config, reference = load_weights(source)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]

    miss = load_model(source, False, dtype)
    hit = load_model(source, False, dtype)

    assert (miss.cache, hit.cache) == ("miss", "hit")
    assert hit.config == miss.config == config
    assert_same(hit.weights, {n: w.to(torch_dtype) for n, w in reference.items()})
    assert_same(miss.weights, hit.weights)
    assert len(entries(home)) == 1


def test_a_changed_source_misses_and_its_stale_entry_is_removed(home: Path, tmp_path) -> None:
    path = tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    first = load_model(resolve_model(str(path)), False, "fp32")
    old_entry = entries(home)
    tiny_gguf(path, seed=1)  # same size, new values
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)

    second = load_model(resolve_model(str(path)), False, "fp32")

    assert (first.cache, second.cache) == ("miss", "miss")
    assert_same(second.weights, load_weights(resolve_model(str(path)))[1])
    assert not torch.equal(first.weights["lm_head.weight"], second.weights["lm_head.weight"])
    assert len(entries(home)) == 1 and entries(home) != old_entry
    assert load_model(resolve_model(str(path)), False, "fp32").cache == "hit"


def test_a_torn_entry_is_rebuilt(home: Path, tmp_path: Path) -> None:
    source = resolve_model(str(tiny_gguf(tmp_path / "tiny.gguf")))
    load_model(source, False, "fp32")
    entry = entries(home)[0]
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])

    rebuilt = load_model(source, False, "fp32")

    assert rebuilt.cache == "miss"
    assert_same(rebuilt.weights, load_weights(source)[1])
    assert load_model(source, False, "fp32").cache == "hit"


def test_int4_weights_round_trip(home: Path, tmp_path: Path) -> None:
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    config = read_config(resolve_model(str(gguf)))
    int4 = Int4Weight.quantize(torch.randn(8, 64), 32)
    dense = torch.randn(8)

    load = model_cache.load_cached(gguf, "int4", lambda: (config, {"a": int4, "b": dense}))
    hit = model_cache.load_cached(gguf, "int4", lambda: pytest.fail("converted twice"))

    assert (load.cache, hit.cache) == ("miss", "hit")
    got = hit.weights["a"]
    assert isinstance(got, Int4Weight) and got.group == 32
    assert all(torch.equal(getattr(got, p), getattr(int4, p)) for p in ("q", "scale", "zero"))
    assert torch.equal(hit.weights["b"], dense)


def test_the_cache_can_be_turned_off(home: Path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_MODEL_CACHE", "0")
    source = resolve_model(str(tiny_gguf(tmp_path / "tiny.gguf")))
    assert load_model(source, False, "fp32").cache == "off"
    assert read_config(source).num_layers == 1
    assert not (home / "cache").exists()


def test_read_config_parses_the_gguf_once(home: Path, tmp_path, monkeypatch) -> None:
    source = resolve_model(str(tiny_gguf(tmp_path / "tiny.gguf")))
    first = read_config(source)
    from kvmesh.engine.loader import gguf_header

    monkeypatch.setattr(gguf_header, "read_header", lambda _: pytest.fail("parsed again"))
    assert read_config(source) == first
    assert isinstance(first, ModelConfig)


def _run_all(scripts: list[str], home: Path) -> list[str]:
    env = {**os.environ, "KVMESH_HOME": str(home)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(s)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in scripts
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    return [out for out, _ in results]


def test_two_processes_populating_the_cache_at_once_agree(home: Path, tmp_path: Path) -> None:
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    script = f"""
        import hashlib
        import torch
        from kvmesh.engine.loader import load_model, resolve_model
        loaded = load_model(resolve_model({str(gguf)!r}), False, "bf16")
        digest = hashlib.sha256()
        for name in sorted(loaded.weights):
            digest.update(name.encode() + loaded.weights[name].view(-1).view(torch.uint8).numpy().tobytes())
        print(loaded.cache, digest.hexdigest())
    """
    outs = [out.strip().splitlines()[-1].split() for out in _run_all([script, script], home)]

    assert sorted(status for status, _ in outs) == ["hit", "miss"]  # the lock: one converts
    assert outs[0][1] == outs[1][1]
    assert load_model(resolve_model(str(gguf)), False, "bf16").cache == "hit"
    assert [p.name for p in entries(home)[0].parent.glob(".*.tmp")] == []


def test_concurrent_writers_never_expose_a_partial_entry(home: Path, tmp_path: Path) -> None:
    """Without the lock: two processes rewrite one entry 15 times each while a third reads it."""
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    target = model_cache.entry_path(gguf, "fp32.safetensors")
    config = read_config(resolve_model(str(gguf)))
    model_cache.write_entry(target, config, {"w": torch.zeros(1 << 20)})
    writer = f"""
        from pathlib import Path
        import torch
        from kvmesh.engine.loader import model_cache
        config = model_cache.config_from_json({model_cache.config_to_json(config)!r})
        for i in range(15):
            model_cache.write_entry(Path({str(target)!r}), config,
                                    {{"w": torch.full((1 << 20,), float(i))}})
    """
    reader = f"""
        from safetensors import safe_open
        for _ in range(60):
            with safe_open({str(target)!r}, framework="pt") as f:
                w = f.get_tensor("w")
                assert w.numel() == 1 << 20 and bool((w == w[0]).all())
        print("ok")
    """
    assert _run_all([writer, writer, reader], home)[2].strip().endswith("ok")
    assert [p.name for p in target.parent.glob(".*.tmp")] == []
