"""INT4 weights on the default model: its GGUF Q4_1 tensors are taken over exactly, so INT4 with
fp32 activations computes the same function as the dense fp32 model (up to summation order);
with bf16 activations it stays close."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh import LLM, SamplingParams

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
