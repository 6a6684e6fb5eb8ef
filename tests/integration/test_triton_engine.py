"""The real engine with `--attention-backend triton` and `--moe-backend triton` (the CUDA
platform's kernels), run on CPU tensors under TRITON_INTERPRET=1: on tiny random Llama (GQA) and
DeepSeek-V3 (MLA + MoE) checkpoints its greedy tokens equal the torch backends', through `kvmesh generate` as a user
runs it and through a batch with chunked prefill, prefix-cache hits, preemption and FP8 pages.
Where the backend cannot run, and `--device cuda` without CUDA, a one-line error (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh_apps.tools.tiny_configs import TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model

pytest.importorskip("triton")
INTERPRET = {**os.environ, "TRITON_INTERPRET": "1"}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

BATCH = textwrap.dedent(
    """
    import json, sys
    import torch
    from kvmesh import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (37, 45, 30)]

    def run(path, backend):
        # 7 pages of 16 tokens hold two of the contexts: the third preempts one
        llm = LLM(path, dtype="fp32", kv_dtype="fp8_e4m3", num_pages=7,
                  max_num_batched_tokens=32, attention_backend=backend, moe_backend=backend)
        preempted, schedule = [], llm.engine.scheduler.schedule
        def spy():
            out = schedule()
            preempted.extend(out.preempted)
            return out
        llm.engine.scheduler.schedule = spy
        first = [o.token_ids for o in llm.generate_ids(prompts, greedy)]
        again = llm.generate_ids(prompts[:2], greedy)  # their prompts' pages cached now
        hits = sum(o.num_cached_tokens for o in again)
        return [first, [o.token_ids for o in again]], hits, len(preempted)

    for path in sys.argv[1:]:
        want, got = run(path, "torch"), run(path, "triton")
        print(json.dumps({"equal": want[0] == got[0], "hits": got[1], "preempted": got[2]}))
    """
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("triton")
    return {
        arch: str(make_tiny_model(TinySpec(arch), root / arch).path)
        for arch in ("llama", "deepseek_v3")
    }


def _kvmesh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        capture_output=True,
        text=True,
        env=env or dict(os.environ),
        timeout=300,
    )


def test_kvmesh_generate_with_triton_attention_gives_the_torch_backends_tokens(checkpoints):
    prompt = "the quick brown fox jumps over the lazy dog, again and again and again"
    options = {"max_num_batched_tokens": 8, "kv_dtype": "bf16"}  # chunks over cached prefixes
    want = LLM(checkpoints["llama"], **options).generate(prompt, GREEDY)[0].token_ids
    args = ["generate", "--model", checkpoints["llama"], "--prompt", prompt, "--json"]
    args += ["--max-tokens", "8", "--temperature", "0", "--max-num-batched-tokens", "8"]
    proc = _kvmesh(*args, "--kv-dtype", "bf16", "--attention-backend", "triton", env=INTERPRET)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]
    assert len(want) == 8 and got == want


def test_a_batch_with_prefix_hits_preemption_and_fp8_pages_gives_the_torch_tokens(checkpoints):
    proc = subprocess.run(
        [sys.executable, "-c", BATCH, *checkpoints.values()],
        capture_output=True,
        text=True,
        env=INTERPRET,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    results = [json.loads(line) for line in lines if line.startswith('{"equal"')]
    for arch, result in zip(checkpoints, results, strict=True):
        assert result["hits"] > 0 and result["preempted"] > 0, (arch, result)
        assert result["equal"], (arch, result)


GRAPHS = textwrap.dedent(
    """
    import json, sys
    import torch
    from kvmesh import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (37, 21)]
    out = {}  # eager steps of the torch backend (the Triton one's tokens: the batch test)
    for backend, step in (("torch", "eager"), ("triton", "graphs")):
        llm = LLM(sys.argv[1], dtype="fp32", kv_dtype="bf16", num_pages=16, max_num_seqs=2,
                  attention_backend=backend, decode_step=step)
        out[step] = [o.token_ids for o in llm.generate_ids(prompts, greedy)]
    graphs = llm.engine.runner.compiled
    print(json.dumps({"equal": out["eager"] == out["graphs"], "ready": sorted(graphs.ready),
                      "replays": graphs.replays}))
    """
)


def test_decode_steps_replayed_from_graphs_give_the_eager_tokens(checkpoints):
    """The graph step's buffers, metadata copies and bucket padding, with the CUDA graph
    recorder swapped for a re-run of the captured function (`eager_record`): on a GPU the
    same step replays CUDA graphs (scripts/device_check.py)."""
    proc = subprocess.run(
        [sys.executable, "-c", GRAPHS, checkpoints["llama"]],
        capture_output=True,
        text=True,
        env=INTERPRET,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"equal"')]
    result = json.loads(lines[-1])
    assert result["ready"] == [1, 2] and result["replays"] > 0, result
    assert result["equal"], result


def _one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


def test_triton_attention_on_the_cpu_without_the_interpreter_is_a_one_line_error(checkpoints):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["generate", "--model", checkpoints["llama"], "--prompt", "hi"]
    proc = _kvmesh(*args, "--attention-backend", "triton", env=env)
    _one_line_error(proc, "--attention-backend triton", "TRITON_INTERPRET=1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
@pytest.mark.parametrize("command", ["serve decode --etcd 127.0.0.1:9", "generate --prompt hi"])
def test_device_cuda_without_cuda_is_a_one_line_error(command, tmp_path: Path):
    env = {**os.environ, "KVMESH_HOME": str(tmp_path)}  # nothing is fetched or loaded first
    _one_line_error(_kvmesh(*command.split(), "--device", "cuda", env=env), "--device cuda")
