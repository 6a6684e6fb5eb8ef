"""FP8 KV and integrity tags on the real default model, in one process.

Injected faults (KVMESH_FAULTS) must each be detected: with kv_integrity_action recompute the hit
request's KV is computed again and its output equals the fault-free engine's; with abort it ends
with a kv_integrity error and every token that reached the caller is one the fault-free engine
would have produced; with the check off, the same faults visibly corrupt the output.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvmesh import LLM, SamplingParams

TEXT = Path(__file__).parents[1] / "data" / "public_domain.txt"

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PERSONAS = ["Ada, a sailor", "Bo, a baker", "Cy, a pilot", "Di, a chemist"]


def _prompts(llm) -> list[list[int]]:  # distinct first pages: no page is shared between them
    return [
        llm.tokenizer.encode_chat(
            [
                {"role": "system", "content": f"{p} speaks."},
                {"role": "user", "content": "Describe your morning."},
            ]
        )
        for p in PERSONAS
    ]


@pytest.fixture(scope="module")
def fp8():
    return LLM(dtype="fp32", kv_dtype="fp8_e4m3", kv_cache_bytes=48 << 20, max_num_seqs=16)


@pytest.fixture(scope="module")
def reference(llm):
    llm.engine.block_manager.reset_prefix_cache()
    return [o.token_ids for o in llm.generate_ids(_prompts(llm), GREEDY)]


def test_fp8_capacity_is_about_twice_bf16_at_the_same_budget():
    budget = 16 << 20
    bf16 = LLM(dtype="bf16", kv_cache_bytes=budget).engine.kv_cache
    fp8 = LLM(dtype="bf16", kv_dtype="fp8_e4m3", kv_cache_bytes=budget).engine.kv_cache
    assert fp8.nbytes <= budget and bf16.nbytes <= budget
    assert fp8.capacity_tokens / bf16.capacity_tokens > 1.9


@pytest.fixture(scope="module")
def fp8_page_chunks():
    """Prefill in page-sized chunks: a cold prompt is cut exactly where a prefix hit ends."""
    return LLM(
        dtype="fp32", kv_dtype="fp8_e4m3", kv_cache_bytes=16 << 20, max_num_batched_tokens=16
    )


def test_fp8_prefix_hit_gives_the_tokens_of_a_cold_run_cut_at_the_same_page(fp8_page_chunks):
    """KV from the prefix cache (or another worker, or the KV store) is bit for bit what this
    engine computes for the same chunk, and attention reads what the pages hold even for a cold
    chunk; so a prefix hit equals a cold run that prefilled in chunks cut where the hit ends, on
    any CPU. (It need not equal a cold run that prefilled the prompt in one chunk: BLAS picks
    GEMM kernels by the number of rows, the rows' last bits differ, and an e4m3 rounding can
    flip -- see docs/internals.md, "What is exact".)"""
    llm = fp8_page_chunks
    for prompt in _prompts(llm):
        llm.engine.block_manager.reset_prefix_cache()
        cold = llm.generate_ids([prompt], GREEDY)[0]
        warm = llm.generate_ids([prompt], GREEDY)[0]
        assert cold.num_cached_tokens == 0
        assert warm.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
        assert cold.token_ids == warm.token_ids


def test_fp8_stays_close_to_fp32_kv_on_a_fixed_text(fp8, llm):
    """Teacher-forced on all of tests/data/public_domain.txt (722 tokens): perplexity within 4 %
    of FP32 KV's and the same argmax at >= 85 % of positions. Measured +1.8 .. +2.7 % and
    88.6 .. 89.7 % on Intel Xeon (AMX) under six ATen / MKL / oneDNN ISA settings, +2.2 % and
    88.5 % on AMD EPYC (docs/benchmarks.md): which e4m3 roundings flip depends on the last bits
    of the machine's GEMMs, so the figure moves by machine, not only by code."""
    ids = llm.tokenizer.encode(TEXT.read_text())
    target = torch.tensor(ids[1:])
    ref = llm.engine.score(ids)[:-1]
    got = fp8.engine.score(ids)[:-1]
    ppl_ref = math.exp(F.cross_entropy(ref, target).item())
    ppl_fp8 = math.exp(F.cross_entropy(got, target).item())
    assert abs(ppl_fp8 / ppl_ref - 1) < 0.04, (ppl_ref, ppl_fp8)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.85, agree


def _run_with_faults(monkeypatch, faults: str, integrity: bool, action: str = "abort"):
    monkeypatch.setenv("KVMESH_FAULTS", faults)
    faulty = LLM(
        dtype="fp32", kv_cache_bytes=32 << 20, kv_integrity=integrity, kv_integrity_action=action
    )
    outs = faulty.generate_ids(_prompts(faulty), GREEDY)
    faulty.engine.block_manager.check_integrity()
    assert faulty.engine.block_manager.num_used_pages == 0
    return faulty.engine, outs


@pytest.mark.parametrize("fault", ["reassign@9", "overwrite@7"])
def test_every_injected_fault_is_caught_and_no_corrupt_token_escapes(monkeypatch, reference, fault):
    engine, outs = _run_with_faults(monkeypatch, fault, integrity=True)
    injected = sum(engine.faults.injected.values())
    failed = [o for o in outs if o.error is not None]
    assert injected >= 1
    assert len(failed) == injected == engine.page_tags.failures
    for out, ref in zip(outs, reference, strict=True):
        if out.error is None:
            assert out.token_ids == ref
        else:
            assert out.error.startswith("kv_integrity: ")
            assert out.finish_reason == "abort"
            assert out.token_ids == ref[: len(out.token_ids)]  # nothing after the fault


@pytest.mark.parametrize("fault", ["reassign@9", "overwrite@7"])
def test_recompute_gives_every_request_the_fault_free_output(monkeypatch, reference, fault):
    engine, outs = _run_with_faults(monkeypatch, fault, integrity=True, action="recompute")
    injected = sum(engine.faults.injected.values())
    assert injected >= 2
    assert engine.page_tags.failures == injected  # each caught, each recomputed
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("fault", ["reassign@9", "overwrite@7"])
def test_the_same_faults_corrupt_output_when_the_check_is_off(monkeypatch, reference, fault):
    engine, outs = _run_with_faults(monkeypatch, fault, integrity=False)
    assert sum(engine.faults.injected.values()) >= 1
    assert all(o.error is None for o in outs)
    assert [o.token_ids for o in outs] != reference
