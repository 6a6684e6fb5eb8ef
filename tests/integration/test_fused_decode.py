"""The fused decode step (engine/runner/fused_decode.py, kernels/csrc/decoder.cpp) on tiny models: its
hidden states and captured layers are the eager forward's bits, its greedy tokens the eager
engine's, it serves every decode-only step, and models it does not fit run eager."""

from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.kernels import cpu_ops, has_amx
from kvmesh.engine.runner.fused_decode import FusedDecode, unfit_reason
from kvmesh_apps.tools.tiny_configs import TinySize, TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels do not run here"),
    pytest.mark.timeout(600),
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LENGTHS = (37, 21, 50, 9, 30)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    # wide enough that the linear kernels' sums differ from torch's (a wrong choice shows)
    spec = TinySpec("llama", size=TinySize(hidden_size=256, intermediate_size=512))
    return str(make_tiny_model(spec, tmp_path_factory.mktemp("llama") / "m").path)


def _checking(llm: LLM, capture: tuple[int, ...]) -> list[tuple[int, bool]]:
    """Runs each fused step's inputs through the eager forward first (the KV written is the
    same) and records (rows, hidden states and captured layers the same bits)."""
    runner, seen = llm.engine.runner, []
    fused = runner.fused
    runner.capture = capture
    forward = fused.forward

    def both(ids, positions, meta, capture=()):
        args = (ids, positions, meta, runner.kv.layers, runner.attention, capture)
        hidden, features = runner.model.forward(*args)
        hidden = hidden.clone()
        got_hidden, got_features = forward(ids, positions, meta, capture)
        same = torch.equal(hidden, got_hidden) and (
            torch.equal(features, got_features) if capture else got_features is None
        )
        seen.append((ids.shape[0], same))
        return got_hidden, got_features

    fused.forward = both
    return seen


@pytest.mark.parametrize(
    "engine",
    [
        {"dtype": "bf16"},
        {"dtype": "bf16", "kv_dtype": "fp8_e4m3"},
        {"dtype": "fp32"},
        {"weights": "int4"},
    ],
    ids=["bf16", "bf16-fp8kv", "fp32", "int4"],
)
def test_fused_steps_are_the_eager_bits_and_tokens(llama, engine):
    _fused_is_eager(llama, engine)


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_steps_in_one_parallel_region_are_the_eager_bits_at_any_thread_count(llama, threads):
    """bf16 steps run in one parallel region (kernels/csrc/decoder_rows.cpp), its threads
    splitting each linear, the KV writes, the attention and the SiLU: the same bits whatever
    their number."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _fused_is_eager(llama, {"dtype": "bf16"})
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("engine", [{"dtype": "bf16"}, {"weights": "int4"}], ids=["bf16", "int4"])
def test_a_thread_that_falls_behind_has_its_chunks_redone_with_the_same_bits(llama, engine):
    """Thread 1 sleeps before its first chunk of every phase (a test hook): thread 0 redoes it
    after waiting (kernels/csrc/phases.h), thread 1 then writes the same values late, and the
    steps stay the eager bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    cpu_ops().set_phase_delay_us(300)
    try:
        _fused_is_eager(llama, engine)
    finally:
        cpu_ops().set_phase_delay_us(0)
        torch.set_num_threads(before)


def test_fp32_linears_as_weight_left_products_are_the_eager_bits(llama, monkeypatch):
    from kvmesh.engine.layers import linear

    monkeypatch.setattr(linear, "WEIGHT_LEFT_MIN", 0)  # the tiny model's linears take it too
    monkeypatch.setattr(linear, "F32_GEMV_ROWS", {})  # not the fp32 GEMV ("fp32" above: it)
    assert linear.dense_kernel(5, torch.zeros(4, 4)) == linear.WEIGHT_LEFT
    llm = _fused_is_eager(llama, {"dtype": "fp32"})
    assert llm.engine.runner.fused.kernels(5) == [linear.WEIGHT_LEFT] * 4  # what the op was told


def _fused_is_eager(llama: str, engine: dict) -> LLM:
    options = dict(num_pages=64, max_num_seqs=5, **engine)
    eager = LLM(llama, decode_step="eager", **options)
    assert eager.engine.runner.fused is None
    want = [o.token_ids for o in eager.generate_ids(_prompts(), GREEDY)]
    llm = LLM(llama, **options)  # fused is the default
    assert llm.engine.runner.fused is not None
    seen = _checking(llm, capture=(0, 1))
    got = [o.token_ids for o in llm.generate_ids(_prompts(), GREEDY)]
    assert got == want
    one = [o.token_ids for o in llm.generate_ids(_prompts()[1:2], GREEDY)]
    assert one == want[1:2]
    assert seen and all(same for _, same in seen), "fused steps must be eager's bits"
    assert {rows for rows, _ in seen} >= {5, 1}, "batched and lone decode steps ran fused"
    assert len(seen) >= GREEDY.max_tokens - 2
    return llm


@pytest.mark.skipif(has_amx(), reason="with AMX, 5+ rows take another linear kernel than 1 row")
def test_drafts_verified_as_decode_rows_give_plain_decodings_bits(llama):
    """n-gram drafts verified in fused steps (each draft a decode row of its own): the greedy
    tokens are plain decoding's, exactly, and every step with drafts ran fused."""
    gen = torch.Generator().manual_seed(9)
    loops = [torch.randint(3, 500, (n,), generator=gen).tolist() * 6 for n in (5, 7, 4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(dtype="bf16", num_pages=64, max_num_seqs=3)
    want = [o.token_ids for o in LLM(llama, **options).generate_ids(loops, params)]
    llm = LLM(llama, speculative="ngram", speculative_policy="fixed", **options)
    runner, rows = llm.engine.runner, []
    forward = runner.fused.forward
    runner.fused.forward = lambda ids, *rest: rows.append(ids.shape[0]) or forward(ids, *rest)
    got = [o.token_ids for o in llm.generate_ids(loops, params)]
    assert got == want
    assert max(rows) > len(loops), f"no step verified drafts in the fused step: {rows}"


def test_biases_of_qkv_and_o_are_added_as_eager_adds_them(llama):
    llm = LLM(llama, dtype="bf16", num_pages=32, max_num_seqs=2)
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(3)
    for layer in runner.model.layers:
        for linear in (layer.attention.qkv, layer.attention.o_proj):
            linear.bias = torch.randn(linear.out_features, generator=gen).to(torch.bfloat16)
    runner.fused = FusedDecode(runner.model, runner.kv.layers)  # registers the biased weights
    seen = _checking(llm, capture=())
    llm.generate_ids(_prompts()[:2], SamplingParams(max_tokens=5, temperature=0.0))
    assert seen and all(same for _, same in seen)


def test_models_and_options_it_does_not_fit_run_eager(llama, tmp_path):
    deepseek = str(make_tiny_model(TinySpec("deepseek_v3"), tmp_path / "ds").path)
    qwen3 = str(make_tiny_model(TinySpec("qwen3"), tmp_path / "qwen3").path)
    for path, options, reason in [
        (deepseek, {}, "other than GQA"),  # MLA
        (qwen3, {}, "no q/k norms"),
        (llama, {"attention_backend": "torch"}, "attention backend"),
    ]:
        llm = LLM(path, num_pages=32, max_num_seqs=2, **options)
        runner = llm.engine.runner
        assert runner.fused is None
        why = unfit_reason(runner.model, runner.attention)
        assert why is not None and reason in why, why
        out = llm.generate_ids(_prompts()[:2], SamplingParams(max_tokens=4, temperature=0.0))
        assert all(len(o.token_ids) == 4 for o in out)
