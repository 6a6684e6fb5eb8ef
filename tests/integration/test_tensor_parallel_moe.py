"""Tensor, expert and pipeline parallelism on the seeds' model shapes (tiny checkpoints written by
transformers' own classes): DeepSeek-V3 / Kimi K2 (MLA + shared and routed experts) and
Qwen3-MoE split over ranks give one rank's greedy tokens and logits within fp32 tolerance --
experts split inside (tensor parallel) or held whole per rank (expert parallel), with FP8 KV
pages and INT4 weights (quantized at load, or a compressed-tensors checkpoint split by whole
groups) -- and each rank holds only its part. A Qwen3 on 4 ranks has 2 KV heads: each is
replicated on two ranks. Pipeline stages (2 or 3, alone or with 2 tensor-parallel ranks each,
a step whole or in micro-batches) give one rank's tokens too."""

from __future__ import annotations

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh_apps.tools.tiny_configs import TinySize, TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [300, 2, 11], [8] * 21, [9, 10], [77, 66, 55, 44, 33]]
WIDE = TinySize(moe_intermediate_size=64)  # experts that split into whole INT4 groups of 32
FP8 = {"kv_dtype": "fp8_e4m3"}
# (arch, tensor ranks, stages, expert parallel, engine options, size, --quantize)
CASES = {
    "mla-moe-tp2": ("deepseek_v3", 2, 1, False, {}, TinySize(), "none"),
    "mla-moe-ep2-fp8": ("deepseek_v3", 2, 1, True, FP8, TinySize(), "none"),
    "mla-moe-ep2-int4": ("deepseek_v3", 2, 1, True, {"weights": "int4"}, WIDE, "none"),
    "mla-moe-tp2-int4-checkpoint": ("deepseek_v3", 2, 1, False, {}, WIDE, "int4-experts"),
    "qwen3-moe-tp2": ("qwen3_moe", 2, 1, False, {}, TinySize(), "none"),
    "qwen3-moe-ep2": ("qwen3_moe", 2, 1, True, FP8, TinySize(), "none"),
    "qwen3-tp4-replicated-kv": ("qwen3", 4, 1, False, {}, TinySize(), "none"),
    "llama-pp2-chunked": (
        "llama",
        1,
        2,
        False,
        {"max_num_batched_tokens": 8},
        TinySize(),
        "none",
    ),  # fmt: skip (prompt chunks before the last sample nothing)
    "llama-pp2-micro-batches": (
        "llama",
        1,
        2,
        False,
        {"pipeline_micro_batches": 2},
        TinySize(),
        "none",
    ),
    "mla-moe-pp3-fp8": ("deepseek_v3", 1, 3, False, FP8, TinySize(), "none"),
    "mla-moe-tp2-pp2-int4": ("deepseek_v3", 2, 2, False, {"weights": "int4"}, WIDE, "none"),
    "qwen3-moe-ep2-pp2-micro-batches": (
        "qwen3_moe",
        2,
        2,
        True,
        {"pipeline_micro_batches": 0},
        TinySize(),
        "none",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_models_give_one_ranks_tokens_and_logits(case, tmp_path):
    arch, ranks, stages, expert_parallel, options, size, quantize = CASES[case]
    spec = TinySpec(arch, size=size, quantize=quantize)
    path = str(make_tiny_model(spec, tmp_path / arch).path)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    one = LLM(model=path, dtype="fp32", max_num_seqs=4, **options)
    want = [o.token_ids for o in one.generate(PROMPTS, params)]
    with LLM(
        model=path,
        dtype="fp32",
        max_num_seqs=4,
        tensor_parallel_size=ranks,
        pipeline_parallel_size=stages,
        enable_expert_parallel=expert_parallel,
        **options,
    ) as split:
        assert [o.token_ids for o in split.generate(PROMPTS, params)] == want
        diff = (one.engine.score(PROMPTS[0]) - split.engine.score(PROMPTS[0])).abs().max()
        whole, part = one.engine.runner.model, split.engine.runner.model
        _check_parts(whole, part, ranks, stages, expert_parallel)
        layout = split.engine.kv_pages.layout
    assert diff < (1e-4 if ranks > 1 else 1e-6), (case, diff)
    page = whole.kv_spec(16, options.get("kv_dtype", "fp32")).page_bytes
    if whole.config.mla is not None and stages == 1:  # the latent on every rank: whole pages
        assert [s.spans for s in layout.shards] == [(range(page),)] * ranks
    if arch == "qwen3":  # 2 KV heads on 4 ranks: each head on two of them
        assert [s.spans[0].start for s in layout.shards] == [0, 0, page // 2, page // 2]
    if stages > 1:  # each stage's pages hold its layers only
        assert sum(s.page_bytes for s in layout.shards) == page * (
            1 if ranks == 1 or whole.config.mla is None else ranks
        )


def _check_parts(whole, part, ranks: int, stages: int, expert_parallel: bool) -> None:
    """Rank 0 holds its stage's layers, its heads and its experts (whole, a share of them) or
    its slice of each."""
    assert part.config.num_heads == whole.config.num_heads // ranks
    assert len(part.layers) == len(whole.layers) // stages
    assert part.weight_bytes < 0.62 * whole.weight_bytes  # the table and norms are shared
    if whole.config.moe is None or not part.config.moe.layers:
        return
    layer = part.config.moe.layers[0]  # (its index in the stage; the stage starts at 0)
    mlp = part.layers[layer].mlp
    experts = (mlp.inner if ranks > 1 else mlp).experts  # (inside the all-reduce)
    held = [e for e in experts if e is not None]
    full = whole.layers[layer].mlp.experts[0]
    if expert_parallel:
        assert len(held) == len(experts) // ranks
        assert held[0].nbytes == full.nbytes
    else:
        assert len(held) == len(experts)
        assert held[0].nbytes * ranks == pytest.approx(full.nbytes, rel=0.02)


def test_a_rank_of_a_later_stage_killed_is_an_engine_failure_in_seconds(tmp_path):
    """TP=2 x PP=2, the last stage's second rank SIGKILLed mid-generation: its stage peer
    waits in their sum and rank 0 in its receive of the logits; rank 0 sees the rank gone
    (checked every 0.5 s while it waits) and the request fails, every rank stopped."""
    import os
    import signal
    import threading
    import time

    from kvmesh.errors import EngineFailure

    path = str(make_tiny_model(TinySpec("qwen3_moe"), tmp_path / "m").path)
    llm = LLM(
        model=path, dtype="fp32", tensor_parallel_size=2, pipeline_parallel_size=2, max_num_seqs=4
    )
    pids = llm.engine.ranks.pids  # global ranks 1, 2, 3
    threading.Timer(1.0, os.kill, (pids[2], signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(EngineFailure, match="gone"):
        llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
        )
    assert time.monotonic() - started < 20
    llm.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
