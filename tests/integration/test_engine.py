"""Engine behaviour on the real default model: caching, batching, preemption, sampling."""

from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.errors import ContextLengthError, InvalidRequestError
from tests.integration.preemption import generate_under_preemption

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SYSTEM = (
    "You are a meticulous assistant for a logistics company. Answer with short, precise "
    "sentences, cite the relevant policy section, and never invent shipment numbers. "
) * 2


def _chat(llm, question: str, system: str = SYSTEM) -> list[int]:
    return llm.tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def test_prefix_cache_hit_gives_the_cold_tokens(llm):
    llm.engine.block_manager.reset_prefix_cache()
    prompt = _chat(llm, "Where is shipment 7?")
    cold = llm.generate_ids([prompt], GREEDY)[0]
    warm = llm.generate_ids([prompt], GREEDY)[0]
    other = llm.generate_ids([_chat(llm, "What is the refund policy?")], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    page = llm.engine.config.cache.page_size
    assert warm.num_cached_tokens == (len(prompt) - 1) // page * page
    assert other.num_cached_tokens >= len(_chat(llm, "")) // page * page - page
    assert warm.token_ids == cold.token_ids
    llm.engine.block_manager.check_integrity()


def test_batch_of_16_equals_each_alone(llm):
    questions = [f"Question {i}: name a colour and a number." for i in range(16)]
    prompts = [_chat(llm, q, system=f"Persona {i}.") for i, q in enumerate(questions)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    llm.engine.block_manager.reset_prefix_cache()
    batched = llm.generate_ids(prompts, params)
    for prompt, together in zip(prompts, batched, strict=True):
        llm.engine.block_manager.reset_prefix_cache()
        alone = llm.generate_ids([prompt], params)[0]
        assert together.token_ids == alone.token_ids
        got = torch.tensor([lp.logprob for lp in together.logprobs])
        want = torch.tensor([lp.logprob for lp in alone.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_preemption_keep_tokens(llm):
    prompts = [_chat(llm, f"Tell me fact number {i} about trains.") for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.engine.block_manager.reset_prefix_cache()
    reference = [o.token_ids for o in llm.generate_ids(prompts, params)]
    outputs, tiny = generate_under_preemption(prompts, params)
    assert [o.token_ids for o in outputs] == reference
    tiny.block_manager.check_integrity()
    assert tiny.block_manager.num_used_pages == 0


def test_seeded_sampling_is_reproducible(llm):
    prompt = _chat(llm, "Invent a name for a cat.")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    first = llm.generate_ids([prompt], params)[0]
    crowd = llm.generate_ids([_chat(llm, "Other"), prompt], params)[1]
    other_seed = llm.generate_ids(
        [prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=99)
    )[0]
    assert first.token_ids == crowd.token_ids
    assert other_seed.token_ids != first.token_ids


def test_stop_string_and_stop_token(llm):
    prompt = llm.tokenizer.encode_chat(
        [{"role": "user", "content": "Count from 1 to 10, comma separated."}]
    )
    free = llm.generate_ids([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert "4" in free.text
    stopped = llm.generate_ids(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=["4"])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("4")]
    token = free.token_ids[3]
    by_id = llm.generate_ids(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[token])
    )[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    assert by_id.finish_reason == "stop"
    assert free.finish_reason == "stop" and free.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_max_tokens_and_logprobs(llm):
    out = llm.generate("The sky is", SamplingParams(max_tokens=5, temperature=0.0, logprobs=2))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(
        lp.rank == 1 and len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in out.logprobs
    )


def test_bad_requests_raise_typed_errors(llm):
    with pytest.raises(ContextLengthError, match="context length"):
        llm.generate_ids([[1] * llm.engine.max_model_len], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate_ids([[10**7]], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate_ids([[]], GREEDY)
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"max_tokens": 0}, {"min_p": 2.0}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    assert not llm.engine.has_unfinished()


def test_bf16_runs_and_mostly_agrees_with_fp32(llm):
    bf16 = LLM(dtype="bf16")
    prompt = _chat(llm, "What is the capital of France?")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    assert bf16.generate_ids([prompt], params)[0].text.strip().startswith("The capital of France")
    assert llm.generate_ids([prompt], params)[0].text.strip().startswith("The capital of France")
