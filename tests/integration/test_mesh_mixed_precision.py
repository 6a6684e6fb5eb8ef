"""One mesh, two weight precisions: KV computed by a bf16 prefill worker is consumed by an INT4
decode worker (and the other way round), served through the openai client. Both workers
advertise their precision in etcd. "Coherent" is measured, not eyeballed: the mesh's greedy
answers must be likely under the fp32 engine (mean token NLL far below that of the same tokens
shuffled) and answer simple factual prompts."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch
import torch.nn.functional as F

from kvmesh.mesh.launcher import Mesh, UpOptions, list_workers
from kvmesh.mesh.up_config import worker_configs
from tests.integration.chat_client import chat_text, client_for

pytestmark = pytest.mark.timeout(600)
SETUPS = {
    "bf16-prefill/int4-decode": ("bf16", "int4"),
    "int4-prefill/bf16-decode": ("int4", "bf16"),
}
FACTS = (
    ("What is the capital of France? Answer in one sentence.", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
)


@pytest.fixture(scope="module", params=sorted(SETUPS))
def mesh(request):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    prefill, decode = SETUPS[request.param]
    options = UpOptions(
        workers=worker_configs(
            "--kv-dtype",
            "bf16",
            "--kv-cache-memory",
            "64MiB",
            prefill=("--weights", prefill),
            decode=("--weights", decode),
        ),
        prefill=1,
        decode=1,
        kvstore="none",
    )
    running = Mesh(options)
    try:
        running.start()
        yield (prefill, decode), running
    finally:
        running.stop()


def _nll(llm, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """Mean negative log-likelihood of answer_ids after prompt_ids under the fp32 engine."""
    ids = prompt_ids + answer_ids
    logits = llm.engine.score(ids)[len(prompt_ids) - 1 : -1]
    return F.cross_entropy(logits, torch.tensor(answer_ids)).item()


def test_mixed_precision_mesh_serves_coherent_text(mesh, llm):
    (prefill, decode), running = mesh
    workers = asyncio.run(list_workers(running.etcd.endpoint, "default"))
    advertised = {w.role: w.extra.get("weights") for w in workers}
    assert advertised == {"prefill": prefill, "decode": decode}
    client = client_for(running)
    for i, (question, fact) in enumerate(FACTS):
        messages = [{"role": "user", "content": question}]
        text = chat_text(
            client,
            bool(i % 2),
            model="smollm2-135m",
            messages=messages,
            max_tokens=40,
            temperature=0.0,
        )
        assert fact.lower() in text.lower(), (prefill, decode, text)
    story = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    response = client.chat.completions.create(
        model="smollm2-135m", messages=story, max_tokens=64, temperature=0.0
    )
    assert response.usage.completion_tokens == 64
    prompt_ids = llm.tokenizer.encode_chat(story)
    answer = llm.tokenizer.encode(response.choices[0].message.content)[:60]
    shuffled = answer[:]
    random.Random(0).shuffle(shuffled)
    fluent, scrambled = _nll(llm, prompt_ids, answer), _nll(llm, prompt_ids, shuffled)
    assert fluent < 1.5 and scrambled > fluent + 3, (fluent, scrambled, answer)
