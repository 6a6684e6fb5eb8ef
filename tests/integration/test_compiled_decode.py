"""The compiled decode step (engine/runner/compiled.py) on tiny models: its greedy tokens are the eager
step's, its graphs serve the decode-only steps of every bucket, padding rows touch no
request's pages, and a model that does not compile whole stays eager with the same tokens."""

from __future__ import annotations

import time

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.kernels import cpu_ops
from kvmesh_apps.tools.tiny_configs import TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels do not run here"),
    pytest.mark.timeout(900),
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
LENGTHS = (37, 21, 50)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in LENGTHS]


def _compiled(path: str, **options) -> LLM:
    llm = LLM(path, num_pages=48, max_num_seqs=3, decode_step="compiled", **options)
    compiled = llm.engine.runner.compiled
    deadline = time.monotonic() + 600
    while compiled.failed is None and len(compiled.ready) < len(compiled.buckets):
        assert time.monotonic() < deadline, "the buckets did not compile in 10 minutes"
        time.sleep(0.2)
    return llm


def _counting(llm: LLM) -> list[int]:
    """Rows of each step the compiled graphs ran."""
    compiled, seen = llm.engine.runner.compiled, []
    run = compiled._run

    def counted(ids, *rest):
        seen.append(ids.shape[0])
        return run(ids, *rest)

    compiled._run = counted
    return seen


def _checking_bits(llm: LLM) -> list[bool]:
    """Runs each compiled step eager too (same inputs: the KV written is the same) and records
    whether the hidden states are the same bits."""
    runner, same = llm.engine.runner, []
    run_model = runner._run_model

    def both(ids, starts, widths, tables, num_decode, bucket):
        if bucket is not None:
            eager = run_model(
                list(ids), list(starts), list(widths), list(tables), num_decode, None
            ).clone()
            compiled = run_model(ids, starts, widths, tables, num_decode, bucket)
            same.append(torch.equal(compiled[: len(eager)], eager))
            return compiled
        return run_model(ids, starts, widths, tables, num_decode, bucket)

    runner._run_model = both
    return same


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(make_tiny_model(TinySpec("llama"), tmp_path_factory.mktemp("llama") / "m").path)


@pytest.mark.parametrize(
    "dtype,kv_dtype", [("bf16", "auto"), ("bf16", "fp8_e4m3"), ("fp32", "auto")]
)
def test_compiled_steps_give_the_eager_tokens(llama, dtype, kv_dtype):
    eager = LLM(llama, dtype=dtype, kv_dtype=kv_dtype, num_pages=48, max_num_seqs=3)
    want = [o.token_ids for o in eager.generate_ids(_prompts(), GREEDY)]
    llm = _compiled(llama, dtype=dtype, kv_dtype=kv_dtype)
    assert llm.engine.runner.compiled.failed is None
    assert llm.engine.runner.compiled.buckets == (1, 2, 3)
    rows = _counting(llm)
    got = [o.token_ids for o in llm.generate_ids(_prompts(), GREEDY)]
    assert got == want
    assert set(rows) == {3} and len(rows) >= GREEDY.max_tokens - 2  # batched decode: bucket 3
    one = [o.token_ids for o in llm.generate_ids(_prompts()[1:2], GREEDY)]
    assert one == want[1:2] and 1 in rows
    kv = llm.engine.kv_cache
    assert not kv.pool[kv.null_page].any(), "padding rows must not write the null page"
    assert kv.pool[kv.scratch_page].any(), "padding rows write the scratch page"
    same = _checking_bits(llm)
    llm.generate_ids(_prompts()[:2], SamplingParams(max_tokens=6, temperature=0.0))
    assert same and all(same), "compiled hidden states must be eager's bits"


def test_a_model_that_does_not_compile_whole_stays_eager(tmp_path):
    path = str(make_tiny_model(TinySpec("deepseek_v3"), tmp_path / "ds").path)
    eager = LLM(path, dtype="bf16", num_pages=48, max_num_seqs=3)
    want = [o.token_ids for o in eager.generate_ids(_prompts(), GREEDY)]
    llm = _compiled(path, dtype="bf16")
    compiled = llm.engine.runner.compiled
    if compiled.failed is None:
        pytest.skip("this MoE model compiled whole here: nothing to fall back from")
    assert compiled.bucket(1) is None
    assert [o.token_ids for o in llm.generate_ids(_prompts(), GREEDY)] == want


def test_an_unknown_decode_step_is_a_clear_error(llama):
    from kvmesh.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="decode_step must be one of"):
        LLM(llama, decode_step="cuda-graphs")
