"""Tensor parallelism on CPU (gloo over loopback): SmolLM2 split over 2 rank processes gives a
single rank's greedy tokens and its logits within fp32 tolerance; each rank holds its part of
the layers; the other ranks end with rank 0, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvmesh import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are"]


@pytest.fixture(scope="module")
def split():
    with LLM(dtype="fp32", tensor_parallel_size=2, max_num_seqs=8) as llm:
        yield llm


def test_two_ranks_give_one_ranks_tokens_and_logits(split, llm):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    llm.engine.block_manager.reset_prefix_cache()
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in split.generate(PROMPTS, params)] == want
    ids = llm.tokenizer.encode(PROMPTS[2] + " red, green and blue.")
    one, two = llm.engine.score(ids), split.engine.score(ids)
    assert torch.allclose(one.float(), two.float(), atol=2e-4, rtol=0), (one - two).abs().max()


def test_staged_ranks_copy_their_own_pools_through_the_shared_block():
    """`--kv-transfer staged` on two ranks (a GPU engine's mode; here pools in host memory):
    each rank's pool is its own and the shared block mirrors them; staging out gives the bytes
    a direct engine's pools hold after the same prompts, staging in brings the block back."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    options = dict(dtype="fp32", tensor_parallel_size=2, max_num_seqs=8, num_pages=64)
    with LLM(**options) as direct, LLM(kv_transfer="staged", **options) as staged:
        want = [o.token_ids for o in direct.generate(PROMPTS, params)]
        assert [o.token_ids for o in staged.generate(PROMPTS, params)] == want
        pages, used = staged.engine.kv_pages, list(range(12))
        assert pages.staged and pages.sharded and not pages.region.any()
        pages.stage_out(used)
        assert torch.equal(pages.gather(used), direct.engine.kv_pages.gather(used))
        pages.region.zero_()
        pages.stage_in(used)  # zeros into every rank's pool
        pages.stage_out(used)
        assert not pages.gather(used).any()


def test_two_pipeline_stages_give_one_ranks_tokens_and_logits_exactly(llm):
    """SmolLM2 in 2 stages of 15 layers (FP8 pages): no sum changes order, so the same bits."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    options = dict(dtype="fp32", kv_dtype="fp8_e4m3", max_num_seqs=8, kv_cache_bytes=64 << 20)
    one = LLM(**options)
    want = [o.token_ids for o in one.generate(PROMPTS, params)]
    ids = one.tokenizer.encode(PROMPTS[2] + " red, green and blue.")
    with LLM(pipeline_parallel_size=2, **options) as staged:
        assert len(staged.engine.runner.model.layers) == 15
        assert [o.token_ids for o in staged.generate(PROMPTS, params)] == want
        assert torch.equal(one.engine.score(ids), staged.engine.score(ids))


# (engine options, logits tolerance, the top-2 gap below which a token may differ): fp32 sums
# differ from one rank's only in their order; bf16 partial outputs are rounded before the sum
PRECISIONS = [
    ({"dtype": "fp32", "kv_dtype": "fp8_e4m3"}, 1e-3, 0.02),
    ({"dtype": "fp32", "weights": "int4"}, 1e-3, 0.02),
    ({"dtype": "bf16"}, 1.5, 1.5),
]


@pytest.mark.parametrize(("options", "atol", "margin"), PRECISIONS)
def test_two_ranks_agree_with_fp8_pages_int4_weights_and_bf16(options, atol, margin):
    """Greedy tokens equal one rank's up to the first step whose top-2 logits are closer than
    `margin` (none in fp32 here), logits within `atol`; one prompt at a time. The top 2 of each
    step come back (logprobs=2) to measure that gap where the tokens part."""
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    one = LLM(max_num_seqs=4, **options)
    want = [one.generate([p], params)[0] for p in PROMPTS]
    ids = one.tokenizer.encode(PROMPTS[2] + " red, green and blue.")
    with LLM(max_num_seqs=4, tensor_parallel_size=2, **options) as two:
        got = [two.generate([p], params)[0] for p in PROMPTS]
        diff = (one.engine.score(ids).float() - two.engine.score(ids).float()).abs().max()
    assert diff <= atol, (options, diff)
    for a, b in zip(want, got, strict=True):
        for step, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                first, second = a.logprobs[step].top[:2]
                assert first[1] - second[1] < margin, (options, step, a.logprobs[step])
                break


def test_each_rank_holds_its_part_of_the_model(split, llm):
    """Rank 0 keeps 1 of SmolLM2's 3 KV heads (3 of 9 query heads), half the MLP and half the
    (tied) embedding / LM head table, by token id; the norms are whole on every rank."""
    whole, part = llm.engine.runner.model, split.engine.runner.model
    assert part.config.num_kv_heads == 1 and part.config.num_heads == 3
    assert part.config.intermediate_size == whole.config.intermediate_size // 2
    assert part.embed.shape[0] == whole.config.vocab_size // 2 and part.lm_head is part.embed
    assert part.weight_bytes < 0.48 * whole.weight_bytes  # 0.458 of the layers, 0.5 of the table


def test_the_other_ranks_end_when_rank_0_is_killed():
    script = (
        "from kvmesh import LLM; import sys, time; "
        "llm = LLM(dtype='fp32', tensor_parallel_size=2, max_num_seqs=4); "
        "print('rank1', llm.engine.ranks.pids[0], flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = next(line for line in proc.stdout if line.startswith("rank1 "))  # past the logs
        rank1 = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20
        while _alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank1), "rank 1 outlived rank 0"
    finally:
        proc.kill()
        proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_checkpoints_split_over_two_ranks(arch, tmp_path):
    """A tiny Llama and a Qwen3 (per-head q/k norms) from transformers' own classes: the same
    tokens and logits on two ranks as on one (one checked against transformers elsewhere)."""
    from kvmesh_apps.tools.tiny_configs import TinySpec
    from kvmesh_apps.tools.tiny_models import make_tiny_model

    path = str(make_tiny_model(TinySpec(arch), tmp_path / arch).path)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 7], [300, 2, 11]]
    one = LLM(model=path, dtype="fp32", max_num_seqs=4)
    want = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(model=path, dtype="fp32", max_num_seqs=4, tensor_parallel_size=2) as two:
        assert (
            two.engine.runner.model.config.num_kv_heads == one.engine.model_config.num_kv_heads // 2
        )
        assert [o.token_ids for o in two.generate(prompts, params)] == want
        diff = (one.engine.score(prompts[0]) - two.engine.score(prompts[0])).abs().max()
    assert diff < 1e-4, diff


def test_a_rank_killed_mid_generation_is_an_engine_failure_at_once():
    """Rank 1 SIGKILLed while rank 0 generates: the next all-reduce fails (its sockets closed),
    the request ends with EngineFailure within seconds, and close() still stops everything."""
    import threading

    from kvmesh.errors import EngineFailure

    llm = LLM(dtype="fp32", tensor_parallel_size=2, max_num_seqs=4)
    rank1 = llm.engine.ranks.pids[0]
    threading.Timer(1.0, os.kill, (rank1, signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(EngineFailure, match="tensor-parallel rank of this engine is gone"):
        llm.generate(
            ["Tell me a long story."],
            SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True),
        )
    assert time.monotonic() - started < 30
    llm.close()
    assert not _alive(rank1)


def test_a_pass_that_fails_on_rank_0_stops_the_ranks():
    """An error inside rank 0's forward pass (here a layer that raises) leaves the other ranks
    waiting in a sum it will never reach: the ranks are stopped, that request and every later
    one end with EngineFailure, and no rank process is left."""
    from kvmesh.errors import EngineFailure

    llm = LLM(dtype="fp32", tensor_parallel_size=2, max_num_seqs=4)
    rank1 = llm.engine.ranks.pids[0]
    layer = llm.engine.runner.model.layers[5].mlp

    def broken(*args):
        raise RuntimeError("a kernel failed")

    layer.inner = broken
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(EngineFailure, match="pass failed on rank 0: a kernel failed"):
        llm.generate(["Hello"], params)
    deadline = time.monotonic() + 20
    while _alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank1)
    with pytest.raises(EngineFailure, match="ranks are stopped"):
        llm.generate(["Hello again"], params)
    llm.close()
