"""Every architecture against transformers' reference implementation (eager attention, eager
experts) on tiny random checkpoints written by `kvmesh make-tiny-model` (the real checkpoint
tensor names): prompt logits of a batch of prompts of different lengths crossing page
boundaries, then 16 decode steps through the paged cache (MLA: absorbed decode after expanded
prefill), greedy tokens; chunked prefill equals one-shot prefill; a prefix-cache hit equals a
cold run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.core.engine import Engine
from kvmesh_apps.tools.tiny_configs import ARCHS, TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model
from tests.integration.arch_harness import RunnerDriver, reference_logits, reference_model

ATOL = 1e-4  # fp32; logits are O(4), measured differences O(1e-5)
LENGTHS = (45, 61, 40)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    specs = {a: TinySpec(a, index_topk=256) if a == "glm_moe_dsa" else TinySpec(a) for a in ARCHS}
    return {a: make_tiny_model(spec, root / a).path for a, spec in specs.items()}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _engine(path: Path) -> Engine:
    return Engine(EngineConfig.of(model=str(path), dtype="fp32", num_pages=64))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_equal_transformers(checkpoints, arch):
    engine, hf = _engine(checkpoints[arch]), reference_model(checkpoints[arch])
    prompts = _prompts(engine.model_config.vocab_size)
    driver = RunnerDriver(engine)
    prefilled = driver.prefill(prompts)
    for prompt, logits in zip(prompts, prefilled, strict=True):
        torch.testing.assert_close(logits, reference_logits(hf, prompt), atol=ATOL, rtol=0)
    last = {f"r{i}": logits[-1] for i, logits in enumerate(prefilled)}
    steps = {req_id: [] for req_id in last}
    for _ in range(16):
        last = driver.decode({r: int(row.argmax()) for r, row in last.items()})
        for req_id, row in last.items():
            steps[req_id].append(row)
    for i, prompt in enumerate(prompts):
        tokens = driver.tokens[f"r{i}"]
        reference = reference_logits(hf, tokens)[len(prompt) :]
        torch.testing.assert_close(torch.stack(steps[f"r{i}"]), reference, atol=ATOL, rtol=0)
        generated = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0].tolist()
        assert tokens == generated


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_one_shot(checkpoints, arch):
    engine = _engine(checkpoints[arch])
    prompts = _prompts(engine.model_config.vocab_size)
    whole = RunnerDriver(engine).prefill(prompts)
    chunked = RunnerDriver(engine).prefill(prompts, chunk=24)  # cuts inside pages
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hit_equals_a_cold_run(checkpoints, arch):
    from kvmesh import LLM, SamplingParams

    llm = LLM(str(checkpoints[arch]), dtype="fp32", num_pages=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = _prompts(llm.engine.model_config.vocab_size)[1]
    cold, warm = (llm.generate_ids([prompt], params)[0] for _ in range(2))
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, len(prompt) // 16 * 16)
    assert cold.token_ids == warm.token_ids
