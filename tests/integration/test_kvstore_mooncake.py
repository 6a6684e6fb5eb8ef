"""The KV store with its second tier in Mooncake Store, on loopback: a real `mooncake_master`, the
in-process gRPC server with its own transfer engine, and a client with another engine. A tiny RAM
tier makes most pages go through Mooncake Store and come back by promotion."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytest.importorskip("mooncake.store")

from kvmesh.mesh.grpc_server import start_server  # noqa: E402
from kvmesh.mesh.kvstore_client import KVStoreClient, layout_key  # noqa: E402
from kvmesh.mesh.mooncake_master import MooncakeMaster  # noqa: E402
from kvmesh.mesh.ports import free_port  # noqa: E402
from kvmesh.mesh.transfer import KvTransferEngine, page_segments  # noqa: E402
from kvmesh.proto.v1 import kvstore_pb2  # noqa: E402
from services.kvstore.server import KVStoreServicer, add_to  # noqa: E402
from services.kvstore.store import KVStore, StoreConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)

PAGE = 4096
LAYOUT = layout_key("tiny", 16, "fp32")
RAM_PAGES, MOONCAKE_PAGES, N = 4, 16, 10
HASHES = [0x2000 + i for i in range(N)]


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")


def tier_pages(stats: kvstore_pb2.GetStatsResponse) -> dict[str, int]:
    return {t.tier: t.pages for t in stats.tiers}


def batches(ids: list[int], size: int = RAM_PAGES) -> list[list[int]]:
    """A reservation or a lease holds at most the RAM pages, so move them in RAM-sized runs."""
    return [ids[i : i + size] for i in range(0, len(ids), size)]


async def scenario(
    master: MooncakeMaster,
    store_te: KvTransferEngine,
    client_te: KvTransferEngine,
    pool: torch.Tensor,
) -> None:
    def pages(ids: list[int]) -> list[int]:
        return page_segments(pool.data_ptr(), PAGE, ids)

    config = StoreConfig(
        LAYOUT,
        PAGE,
        RAM_PAGES * PAGE,
        MOONCAKE_PAGES * PAGE,
        backend="mooncake",
        mooncake_master=master.address,
    )
    store = KVStore(config, store_te)
    server = None
    try:
        servicer = add_to(KVStoreServicer(store))
        server, port, _ = await start_server([servicer], "127.0.0.1", free_port())
        async with KVStoreClient(f"127.0.0.1:{port}", client_te, timeout_s=20) as client:
            for ids in batches(list(range(N))):
                assert await client.offer(
                    [HASHES[i] for i in ids], pages(ids), PAGE, LAYOUT
                ) == len(ids)
            assert tier_pages(await client.stats()) == {"ram": RAM_PAGES, "mooncake": N - RAM_PAGES}
            for ids in batches(list(range(N))):
                dst = [N + i for i in ids]
                assert await client.fetch(
                    [HASHES[i] for i in ids], pages(dst), PAGE, LAYOUT
                ) == len(ids)
            assert torch.equal(pool[N : 2 * N], pool[:N])
            stats = await client.stats()
            assert stats.promotions == N and stats.corrupt_pages == 0  # every page via Mooncake
            assert tier_pages(stats) == {"ram": RAM_PAGES, "mooncake": N - RAM_PAGES}
            store.check_integrity()

            master.stop()  # Mooncake calls now fail after ~4 s each: a miss, never a crash
            started = time.monotonic()
            assert await client.fetch(HASHES[:1], pages([2 * N]), PAGE, LAYOUT) == 0
            assert time.monotonic() - started < 15
            store.check_integrity()
    finally:
        if server is not None:
            await server.stop(grace=None)
        store.close()


def test_pages_round_trip_through_mooncake_store_and_a_lost_master_is_a_miss() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (2 * N + 1, PAGE), generator=gen, dtype=torch.uint8)
    pool[N:] = 0
    master = MooncakeMaster()
    store_te = client_te = None
    try:
        master.start()
        store_te, client_te = KvTransferEngine(), KvTransferEngine()
        client_te.register(pool.data_ptr(), pool.numel())
        asyncio.run(asyncio.wait_for(scenario(master, store_te, client_te, pool), 45))
    finally:
        for engine in (client_te, store_te):
            if engine is not None:
                engine.close()  # ~1 s each
        master.stop()
