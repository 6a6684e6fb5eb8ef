"""FP8 KV and integrity tags through the mesh (real processes, openai client).

The mesh runs FP8 KV with faults injected (KVMESH_FAULTS in the workers' environment): every
3rd prefill->decode transfer loses its last page, and every 40th decode step a live page is
overwritten by a stale writer. With --kv-integrity-action recompute (the default) every answer is
exactly the single-process FP8 engine's; with abort each is that answer or a `kv_integrity`
error after a correct beginning. No corrupted text reaches the client, and every injected fault
is counted as detected.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import worker_configs
from tests.integration.chat_client import ask_or_error
from tests.integration.mesh_probes import mesh_with_faults, metric_sum

pytestmark = pytest.mark.timeout(600)
FAULTS = "drop_transfer@3,overwrite@40"
WORKER_ARGS = ("--kv-dtype", "fp8_e4m3", "--kv-cache-memory", "48MiB")
TOPICS = ["tides", "volcanoes", "bees", "comets", "glaciers", "owls", "deserts", "coral"]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["recompute", "abort"])
def mesh(request):
    args = (*WORKER_ARGS, "--kv-integrity-action", request.param)
    options = UpOptions(workers=worker_configs(*args), prefill=1, decode=1, kvstore="none")
    with mesh_with_faults(options, FAULTS) as running:
        yield request.param, running


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Each topic's answer from a fresh engine, each prompt computed once: a second pass
    would hit the engine's prefix cache, and FP8 pages read back need not give the same
    bits as a fresh prefill's (the mesh computes each prompt afresh too)."""
    llm = LLM(dtype="fp32", kv_dtype="fp8_e4m3", kv_cache_bytes=48 << 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return {topic: llm.chat(_ask(topic), params)[0].text for topic in TOPICS}


def _ask(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me one fact about {topic}."}]


def test_faults_are_detected_and_only_exact_answers_reach_the_client(mesh, reference):
    action, mesh = mesh
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="x", max_retries=0, timeout=120
    )
    errors = 0
    for i, topic in enumerate(TOPICS):
        messages, want = _ask(topic), reference[topic]
        got, code = ask_or_error(client, messages, bool(i % 2), "smollm2-135m", MAX_TOKENS)
        if code is None:
            assert got == want, topic
        else:
            errors += 1
            assert code == "kv_integrity", (topic, code)
            assert want.startswith(got), (topic, got)  # streamed tokens before the fault were right
    workers = asyncio.run(list_workers(mesh.etcd.endpoint, "default"))
    decode = next(w for w in workers if w.role == "decode")
    prefill = next(w for w in workers if w.role == "prefill")
    failures = metric_sum(decode.metrics_address, "kvmesh_kv_integrity_failures_total")
    injected = metric_sum(decode.metrics_address, "kvmesh_faults_injected_total") + metric_sum(
        prefill.metrics_address, "kvmesh_faults_injected_total"
    )
    if action == "recompute":
        assert errors == 0 and failures == injected >= 2  # drops alone hit 8 // 3 requests
        return
    assert errors >= 2  # drops alone hit at least 8 // 3 requests
    assert failures == injected >= errors
    assert errors < len(TOPICS)  # and the mesh kept answering
