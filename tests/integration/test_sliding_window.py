"""A model with a sliding window (Mistral v0.1's `sliding_window`) is served up to its window,
where full attention is what the model computes, and a longer prompt is refused naming the
window: within it, logits and greedy tokens equal transformers' Mistral; past it transformers'
own logits change (the window binds), which is where kvmesh does not go."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.errors import ContextLengthError
from kvmesh_apps.tools.tiny_configs import TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model
from tests.integration.arch_harness import reference_logits, reference_model

WINDOW = 24


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Path:
    """kvmesh's tiny llama relabelled as Mistral (the same tensors) with a 24-token window."""
    path = make_tiny_model(TinySpec("llama"), tmp_path_factory.mktemp("mistral") / "m").path
    config = json.loads((path / "config.json").read_text())
    config |= {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": WINDOW,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llm(mistral) -> LLM:
    return LLM(str(mistral), dtype="fp32", num_pages=16)


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_within_the_window_logits_and_tokens_equal_transformers(mistral, llm):
    assert llm.engine.max_model_len == WINDOW
    hf, prompt = reference_model(mistral), _prompt(WINDOW - 10)
    torch.testing.assert_close(
        llm.engine.score(prompt), reference_logits(hf, prompt), atol=1e-4, rtol=0
    )
    params = SamplingParams(max_tokens=WINDOW, temperature=0.0, ignore_eos=True)
    [out] = llm.generate_ids([prompt], params)
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == WINDOW
    reference = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=len(out.token_ids),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out.token_ids == reference[0, len(prompt) :].tolist()


def test_past_the_window_is_refused_where_the_window_would_change_the_answer(mistral, llm):
    prompt = _prompt(WINDOW + 8)
    with pytest.raises(ContextLengthError, match=f"sliding-window .* {WINDOW} tokens"):
        llm.generate_ids([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    windowed, full = reference_model(mistral), reference_model(mistral)
    full.config.sliding_window = None
    last = reference_logits(windowed, prompt)[-1], reference_logits(full, prompt)[-1]
    assert (last[0] - last[1]).abs().max() > 1e-3  # the window binds past WINDOW tokens
