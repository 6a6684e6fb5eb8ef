"""Our model equals transformers' reference on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "List three prime numbers.",
    "Explain recursion to a child in two sentences.",
]


def test_prompt_logits_match_transformers(llm, hf_reference):
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the moon."}])
    ours = llm.engine.score(ids)
    with torch.no_grad():
        ref = hf_reference(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("question", CHAT_PROMPTS)
def test_greedy_64_tokens_match_transformers(llm, hf_reference, question):
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": question}])
    ours = llm.generate_ids([ids], SamplingParams(max_tokens=64, temperature=0.0))[0]
    with torch.no_grad():
        ref = hf_reference.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
    assert ours.token_ids == ref[0, len(ids) :].tolist()
    assert ours.text.strip()


def _save_tiny(tmp_path, default_model_source, config) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF zero-initialises biases: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path, max_shard_size="2MB")  # forces a sharded index
    gguf = default_model_source.gguf_file
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp_path)
    return str(tmp_path)


TINY = {
    "llama-gqa-llama3-rope": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-bias-tied": dict(
        model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True
    ),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_random_safetensors_match_transformers(tmp_path, default_model_source, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(TINY[name])
    config = AutoConfig.for_model(
        extra.pop("model_type"),
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        **extra,
    )
    path = _save_tiny(tmp_path, default_model_source, config)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="fp32", kv_cache_bytes=8 << 20)
    ids = list(range(100, 300, 3))  # 67 tokens: several pages, crosses the llama3 boundary
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        greedy = ref.generate(
            torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    torch.testing.assert_close(llm.engine.score(ids), expected, atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert llm.generate_ids([ids], params)[0].token_ids == greedy
