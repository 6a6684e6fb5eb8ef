"""INT4 weights on the default model: its GGUF Q4_1 tensors are taken over exactly, so INT4 with
fp32 activations computes the same function as the dense fp32 model (up to summation order);
with bf16 activations it stays close."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh import LLM, SamplingParams
from kvmesh.engine.quant.int4 import Int4Linear

TEXT = Path(__file__).parents[1] / "data" / "public_domain.txt"


def test_int4_from_q4_1_is_the_dense_model(llm):
    int4 = LLM(dtype="fp32", weights="int4", kv_cache_bytes=32 << 20)
    ids = llm.tokenizer.encode(TEXT.read_text())[:256]
    torch.testing.assert_close(int4.engine.score(ids), llm.engine.score(ids), atol=2e-3, rtol=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers."}])
    llm.engine.block_manager.reset_prefix_cache()
    assert (
        int4.generate_ids([prompt], params)[0].token_ids
        == llm.generate_ids([prompt], params)[0].token_ids
    )


def test_int4_with_bf16_activations_stays_close_on_a_fixed_text(llm):
    int4 = LLM(dtype="bf16", weights="int4", kv_cache_bytes=32 << 20)
    ids = llm.tokenizer.encode(TEXT.read_text())[:512]
    target = torch.tensor(ids[1:])
    ref = math.exp(F.cross_entropy(llm.engine.score(ids)[:-1], target).item())
    got = math.exp(F.cross_entropy(int4.engine.score(ids)[:-1], target).item())
    assert abs(got / ref - 1) < 0.03, (ref, got)


def test_int4_embeddings_share_one_table_and_cut_weights_to_under_a_third(llm):
    int4 = LLM(dtype="bf16", weights="int4", int4_embeddings=True, kv_cache_bytes=32 << 20)
    model = int4.engine.runner.model
    assert isinstance(model.embed, Int4Linear) and model.lm_head is model.embed
    dense = llm.engine.runner.model  # fp32: 4 bytes per parameter
    ratio = model.weight_bytes / (dense.weight_bytes / 2)
    assert 0.30 < ratio < 0.32, ratio  # Q4_1's own 5 bits per weight, bf16 scales and zeros
    ids = llm.tokenizer.encode(TEXT.read_text())[:512]
    target = torch.tensor(ids[1:])
    ref = math.exp(F.cross_entropy(llm.engine.score(ids)[:-1], target).item())
    got = math.exp(F.cross_entropy(int4.engine.score(ids)[:-1], target).item())
    assert 1.0 < got / ref < 1.10, (ref, got)  # the requantized Q8_0 table costs a few percent
    out = int4.chat(
        [{"role": "user", "content": "What is the capital of Japan?"}],
        SamplingParams(max_tokens=16, temperature=0.0),
    )
    assert "Tokyo" in out[0].text


def test_int4_quantized_at_load_from_fp16_safetensors(tmp_path, default_model_source, llm):
    """The HF-folder path: fp16 safetensors in, INT4 (round-to-nearest with the scale search)
    out. The fp16 values sit on Q4_1's grid up to fp16 rounding, so the search finds it again."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from kvmesh.engine.loader import load_weights

    # the GGUF's tensors under HF names, as the loader reads them (transformers' own GGUF
    # reading gives the same values -- test_parity -- in 13 s of Python instead of 1)
    gguf = default_model_source.gguf_file
    _, weights = load_weights(default_model_source)
    state = {k: weights.read(k, torch.float16).contiguous() for k in weights}
    save_file(state, str(tmp_path / "model.safetensors"))  # tied: the LM head is the embedding
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    llm.tokenizer.hf.save_pretrained(tmp_path)
    int4 = LLM(model=str(tmp_path), weights="int4", kv_cache_bytes=32 << 20)
    layer = int4.engine.runner.model.layers[0]
    linears = (layer.attention.qkv, layer.attention.o_proj, layer.mlp.gate_up, layer.mlp.down)
    assert all(isinstance(w, Int4Linear) for w in linears)
    assert int4.engine.config.compute_dtype == "bf16"
    ids = llm.tokenizer.encode(TEXT.read_text())[:512]
    target = torch.tensor(ids[1:])
    ref = math.exp(F.cross_entropy(llm.engine.score(ids)[:-1], target).item())
    got = math.exp(F.cross_entropy(int4.engine.score(ids)[:-1], target).item())
    assert abs(got / ref - 1) < 0.03, (ref, got)
