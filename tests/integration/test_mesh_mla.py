"""The mesh on an MLA + MoE model (tiny DeepSeek-V3 in Kimi K2's shape, `kvmesh make-tiny-model`):
etcd, gateway, 1 prefill + 1 decode + the KV store as real processes, FP8 latent pages moved by
the transfer engine (gRPC carries only metadata), every 4th transfer losing its last page.
Also with a prefill worker of two tensor-parallel ranks (experts partitioned) feeding a decode
worker of two pipeline stages, and a prefill worker of two stages feeding a decode worker of two
tensor-parallel ranks. Through the openai client, streamed and not, each answer is exactly the single-process FP8
engine's or a `kv_integrity` error; a repeated prompt is served from the prefix cache; every
injected fault is detected; etcd advertises the
architecture and the KV spec, and the store holds pages of that spec."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import worker_configs
from kvmesh_apps.tools.tiny_configs import TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model
from tests.integration.chat_client import ask_or_error
from tests.integration.mesh_probes import mesh_with_faults, metric_sum

pytestmark = pytest.mark.timeout(600)
WORKER_ARGS = (
    "--dtype",
    "fp32",
    "--kv-dtype",
    "fp8_e4m3",
    "--kv-cache-memory",
    "8MiB",
    "--kv-integrity-action",
    "abort",
)  # a dropped page shows as an error here
TOPICS = ["tides", "volcanoes", "bees", "comets", "glaciers", "owls", "deserts", "coral"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(TinySpec("deepseek_v3"), tmp_path_factory.mktemp("m") / "kimi").path)


# parallel layouts per role: MLA's latent pages are replicated on every tensor-parallel rank,
# so pages cross between layouts from one replica each; a pipeline stage's pages hold its layers'
# latents and FP8 scales (two spans a page); the MoE layers split inside each expert or, with
# expert parallelism, hold whole experts per rank
LAYOUTS = {
    "prefill-tp2-ep/decode-pp2": {
        "prefill": ("--tensor-parallel-size", "2", "--enable-expert-parallel"),
        "decode": ("--pipeline-parallel-size", "2"),
    },
    "prefill-pp2/decode-tp2": {
        "prefill": ("--pipeline-parallel-size", "2"),
        "decode": ("--tensor-parallel-size", "2"),
    },
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def mesh(model, request):
    options = UpOptions(
        workers=worker_configs("--model", model, *WORKER_ARGS, **LAYOUTS[request.param]),
        prefill=1,
        decode=1,
        kvstore="builtin",
    )
    with mesh_with_faults(options, "drop_transfer@4") as running:
        yield running


def test_mla_mesh_answers_exactly_or_reports_the_fault(mesh, model):
    import openai

    reference = LLM(model, dtype="fp32", kv_dtype="fp8_e4m3", kv_cache_bytes=8 << 20)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="x", max_retries=0, timeout=120
    )
    params = SamplingParams(max_tokens=24, temperature=0.0)
    errors = exact = 0
    for i, topic in enumerate(TOPICS):
        messages = [{"role": "user", "content": f"Tell me one fact about {topic}."}]
        want = reference.chat(messages, params)[0].text
        got, code = ask_or_error(client, messages, bool(i % 2), "kimi", 24)
        if code is None:
            assert got == want, topic
            exact += 1
        else:
            errors += 1
            assert code == "kv_integrity", (topic, code)
            assert want.startswith(got), (topic, got)
    again = [{"role": "user", "content": f"Tell me one fact about {TOPICS[1]}."}]
    repeat = client.chat.completions.create(
        model="kimi", messages=again, max_tokens=24, temperature=0.0
    )  # fmt: skip (9th transfer: kept)
    assert repeat.choices[0].message.content == reference.chat(again, params)[0].text
    assert repeat.usage.prompt_tokens_details.cached_tokens >= 16  # latent pages from the cache
    workers = {w.role: w for w in asyncio.run(list_workers(mesh.etcd.endpoint, "default"))}
    decode, prefill = workers["decode"], workers["prefill"]
    injected = metric_sum(prefill.metrics_address, "kvmesh_faults_injected_total")
    assert errors >= 1 and exact >= 4
    assert metric_sum(decode.metrics_address, "kvmesh_kv_integrity_failures_total") == injected
    assert injected >= errors
    assert metric_sum(prefill.metrics_address, "kvmesh_kv_transfer_bytes_total") > 0
    for worker in (decode, prefill):
        assert 0 < metric_sum(worker.metrics_address, "kvmesh_grpc_message_bytes_max") < 64 << 10
        assert worker.extra["architecture"] == "deepseek_v3"
        assert ":mla1x80:" in worker.extra["kv_spec"] and worker.kv_dtype == "fp8_e4m3"
    assert decode.extra["kv_spec"] in workers["kvstore"].extra["layout_key"]
