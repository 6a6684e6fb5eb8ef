"""The KV store in the mesh: pages evicted from the workers come back from the store (through
its disk tier), outputs are unchanged, and a store that dies only costs cache misses."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvmesh.mesh.grpc_server import channel
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import kvstore_config, worker_configs
from kvmesh.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.integration.mesh_probes import offers_done, running_mesh, wait_for

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=["builtin", "mooncake"])
def mesh(request):
    """The store's second tier: its own disk directory, or Mooncake Store (mooncake_master)."""
    options = UpOptions(
        workers=worker_configs("--kv-cache-mib", "32"),
        prefill=1,
        decode=1,
        kvstore=request.param,
        store=kvstore_config("--ram-mib", "32", "--disk-mib", "256"),
    )
    with running_mesh(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh):
    from openai import OpenAI

    return OpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="k", max_retries=0, timeout=300
    )


def _ask(client, topic: str, n: int = 70):
    system = f"Notes on {topic}. " + " ".join(f"{topic} fact {i} holds." for i in range(n))
    return client.chat.completions.create(
        model="smollm2-135m",
        max_tokens=8,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}],
    )


def _store_stats(mesh):
    async def get():
        workers = await list_workers(mesh.etcd.endpoint, "default")
        store = next(w for w in workers if w.role == "kvstore")
        async with channel(store.grpc_address) as ch:
            return await kvstore_pb2_grpc.KVStoreStub(ch).GetStats(kvstore_pb2.GetStatsRequest())

    return asyncio.run(get())


def test_evicted_prefix_comes_back_from_the_stores_second_tier(client, mesh):
    first = _ask(client, "otters")
    assert first.usage.prompt_tokens > 300
    for topic in ("granite", "violins", "comets"):  # evict the otters pages from both workers
        _ask(client, topic)
    wait_for(lambda: offers_done(mesh), 30, "page offers to the store still in flight")
    again = _ask(client, "otters")
    assert again.choices[0].message.content == first.choices[0].message.content
    assert (
        again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16
    )
    stats = _store_stats(mesh)
    second = next(t for t in stats.tiers if t.tier != "ram")  # "disk" or "mooncake"
    assert second.hits > 0 and stats.promotions > 0
    assert _prefill_metric(mesh, 'kvmesh_prefix_hit_tokens_total{tier="kvstore"}') >= 256


def _prefill_metric(mesh, name: str) -> float:
    import urllib.request

    workers = asyncio.run(list_workers(mesh.etcd.endpoint, "default"))
    total = 0.0
    for worker in (w for w in workers if w.role == "prefill"):
        with urllib.request.urlopen(f"http://{worker.metrics_address}/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
        total += sum(float(line.split()[-1]) for line in lines if line.startswith(name))
    return total


def test_a_dead_store_only_costs_misses(client, mesh):
    store = mesh.procs["kvstore"]
    os.kill(store.pid, signal.SIGKILL)
    store.wait(10)
    reply = _ask(client, "lighthouses")
    again = _ask(client, "lighthouses")
    assert reply.choices[0].message.content == again.choices[0].message.content
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
