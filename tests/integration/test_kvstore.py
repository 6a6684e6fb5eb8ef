"""The KV store service on loopback: in-process gRPC server with its own transfer engine, and a
client with another engine and a torch page pool. Page bytes move only through the engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

pytest.importorskip("mooncake.engine")

from kvmesh.config.knobs import build  # noqa: E402
from kvmesh.config.kvstore import KVStoreConfig  # noqa: E402
from kvmesh.engine.kv.pool_layout import PoolLayout, PoolShard  # noqa: E402
from kvmesh.errors import InvalidRequestError  # noqa: E402
from kvmesh.mesh.discovery import Registry, WorkerInfo  # noqa: E402
from kvmesh.mesh.etcd_server import EtcdServer  # noqa: E402
from kvmesh.mesh.grpc_server import start_server  # noqa: E402
from kvmesh.mesh.kvstore_client import KVStoreClient, layout_key  # noqa: E402
from kvmesh.mesh.ports import free_port  # noqa: E402
from kvmesh.mesh.transfer import KvTransferEngine, page_segments  # noqa: E402
from kvmesh.proto.v1 import kvstore_pb2  # noqa: E402
from services.kvstore.main import checked, serve_kvstore  # noqa: E402
from services.kvstore.server import KVStoreServicer, add_to  # noqa: E402
from services.kvstore.store import KVStore, StoreConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)

PAGE = 4096
LAYOUT = layout_key("tiny", 16, "fp32")
NUM_PAGES = 32
HASHES = [0x1000 + i for i in range(8)]


@dataclass
class Engines:
    store: KvTransferEngine
    client: KvTransferEngine
    pool: torch.Tensor  # the client's pages: [NUM_PAGES, PAGE] uint8

    def pages(self, ids: list[int]) -> list[int]:
        return page_segments(self.pool.data_ptr(), PAGE, ids)


@pytest.fixture(scope="module")
def engines():
    store, client = KvTransferEngine(), KvTransferEngine()
    pool = torch.zeros(NUM_PAGES, PAGE, dtype=torch.uint8)
    try:
        client.register(pool.data_ptr(), pool.numel())
        yield Engines(store, client, pool)
    finally:
        client.close()  # ~1 s each
        store.close()


@pytest.fixture
def te(engines: Engines) -> Engines:
    gen = torch.Generator().manual_seed(0)
    engines.pool.copy_(torch.randint(0, 256, engines.pool.shape, generator=gen, dtype=torch.uint8))
    return engines


def run(coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def serving(te: Engines, ram_pages: int = 16, disk_pages: int = 0, tmp: Path | None = None):
    """A store + gRPC server on a free port, and a client; all stopped on exit."""
    config = StoreConfig(LAYOUT, PAGE, ram_pages * PAGE, disk_pages * PAGE, tmp)
    store = KVStore(config, te.store)
    server = None
    try:
        server, port, _ = await start_server(
            [add_to(KVStoreServicer(store))], "127.0.0.1", free_port()
        )
        async with KVStoreClient(f"127.0.0.1:{port}", te.client) as client:
            yield store, client
    finally:
        if server is not None:
            await server.stop(grace=None)
        store.close()


def tier_pages(stats: kvstore_pb2.GetStatsResponse) -> dict[str, int]:
    return {t.tier: t.pages for t in stats.tiers}


def test_a_stored_page_corrupted_in_ram_is_a_miss_for_the_reader(te: Engines) -> None:
    """Every page carries its committed digest; the reader hashes what it copied."""

    async def scenario() -> None:
        async with serving(te) as (store, client):
            assert await client.offer(HASHES, te.pages(list(range(8))), PAGE, LAYOUT) == 8
            slot = store.pages.ram.get(HASHES[3]).slot
            store.pages.ram.pool[slot, 100] ^= 0xFF  # a stray write into the store's RAM
            dst = list(range(16, 24))
            assert await client.fetch(HASHES, te.pages(dst), PAGE, LAYOUT) == 3
            assert torch.equal(te.pool[16:19], te.pool[0:3])

    run(scenario())


def test_offer_then_fetch_moves_identical_bytes(te: Engines) -> None:
    async def scenario() -> None:
        async with serving(te) as (store, client):
            assert await client.offer(HASHES, te.pages(list(range(8))), PAGE, LAYOUT) == 8
            assert await client.offer(HASHES, te.pages(list(range(8))), PAGE, LAYOUT) == 0
            dst = list(range(16, 24))
            assert await client.fetch(HASHES, te.pages(dst), PAGE, LAYOUT) == 8
            assert torch.equal(te.pool[16:24], te.pool[0:8])
            # A leading run only: the third hash is unknown.
            partial = [*HASHES[:2], 0xDEAD, HASHES[3]]
            assert await client.fetch(partial, te.pages([24, 25, 26, 27]), PAGE, LAYOUT) == 2
            stats = await client.stats()
            assert tier_pages(stats) == {"ram": 8} and stats.leases == 0
            store.check_integrity()

    run(scenario())


def test_layout_mismatch_is_invalid_argument(te: Engines) -> None:
    async def scenario() -> None:
        async with serving(te) as (_, client):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.stub.Lookup(
                    kvstore_pb2.LookupRequest(block_hashes=HASHES, page_bytes=PAGE, layout_key="x")
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "kv_layout_mismatch" in err.value.details()
            other = layout_key("tiny", 16, "bf16")
            assert await client.offer(HASHES, te.pages(list(range(8))), PAGE, other) == 0
            assert await client.fetch(HASHES, te.pages(list(range(8))), PAGE // 2, LAYOUT) == 0

    run(scenario())


def test_tiny_ram_evicts_to_disk_and_fetch_returns_correct_bytes(
    te: Engines, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with serving(te, ram_pages=4, disk_pages=16, tmp=tmp_path) as (store, client):
            for i in range(0, 8, 4):  # one reservation holds at most the RAM pages
                offered = await client.offer(
                    HASHES[i : i + 4], te.pages([i, i + 1, i + 2, i + 3]), PAGE, LAYOUT
                )
                assert offered == 4
            assert tier_pages(await client.stats()) == {"ram": 4, "disk": 4}
            dst = list(range(16, 20))
            assert await client.fetch(HASHES[:4], te.pages(dst), PAGE, LAYOUT) == 4
            assert torch.equal(te.pool[16:20], te.pool[0:4])
            stats = await client.stats()
            assert stats.promotions == 4 and tier_pages(stats) == {"ram": 4, "disk": 4}
            assert await client.fetch(HASHES[4:], te.pages(dst), PAGE, LAYOUT) == 4
            assert torch.equal(te.pool[16:20], te.pool[4:8])
            store.check_integrity()

    run(scenario())


def test_restarted_store_has_no_pages(te: Engines) -> None:
    async def scenario() -> None:
        async with serving(te, disk_pages=8) as (_, client):
            assert await client.offer(HASHES, te.pages(list(range(8))), PAGE, LAYOUT) == 8
        async with serving(te, disk_pages=8) as (_, client):
            assert await client.fetch(HASHES, te.pages(list(range(16, 24))), PAGE, LAYOUT) == 0

    run(scenario())


def test_uncommitted_reservation_is_invisible(te: Engines) -> None:
    async def scenario() -> None:
        async with serving(te) as (store, client):
            reserved = await client.stub.Reserve(
                kvstore_pb2.ReserveRequest(
                    block_hashes=HASHES[:2], page_bytes=PAGE, layout_key=LAYOUT
                )
            )
            assert list(reserved.accepted_hashes) == HASHES[:2]
            te.client.write_pages(reserved.te_session, te.pages([0, 1]), reserved.addresses, PAGE)
            assert await client.fetch(HASHES[:2], te.pages([16, 17]), PAGE, LAYOUT) == 0
            done = await client.stub.Commit(
                kvstore_pb2.CommitRequest(reservation_id=reserved.reservation_id, digests=[1, 2])
            )
            assert (done.committed, done.rejected) == (0, 2)  # wrong digests: dropped
            assert await client.fetch(HASHES[:2], te.pages([16, 17]), PAGE, LAYOUT) == 0
            store.check_integrity()

    run(scenario())


def test_store_down_costs_only_misses(te: Engines) -> None:
    async def scenario() -> None:
        async with KVStoreClient(f"127.0.0.1:{free_port()}", te.client, timeout_s=2) as client:
            assert await client.fetch(HASHES, te.pages(list(range(8))), PAGE, LAYOUT) == 0
            assert await client.offer(HASHES, te.pages(list(range(8))), PAGE, LAYOUT) == 0

    run(scenario())


async def _until_registered(registry: Registry) -> list:
    while not (found := await registry.list_workers("kvstore")):
        await asyncio.sleep(0.05)
    return found


def test_serve_kvstore_registers_in_etcd(tmp_path: Path) -> None:
    async def scenario(etcd: EtcdServer) -> None:
        stop = asyncio.Event()
        options = build(
            KVStoreConfig,
            etcd=etcd.endpoint,
            page_bytes=PAGE,
            model="tiny",
            ram_mib=1,
            disk_mib=1,
            lease_ttl=2,
        )
        task = asyncio.create_task(serve_kvstore(options, stop))
        try:
            async with Registry(etcd.endpoint) as registry:
                (info,) = await asyncio.wait_for(_until_registered(registry), 15)
                assert info.te_session and info.extra["layout_key"] == LAYOUT
                assert info.extra["ram_pages"] == 256
                async with KVStoreClient(info.grpc_address, _NoTransfer()) as client:
                    assert (await client.stats()).page_bytes == PAGE
                stop.set()
                await asyncio.wait_for(task, 15)
                assert await registry.list_workers("kvstore") == []
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 15)

    with EtcdServer() as etcd:
        run(scenario(etcd), timeout=45)


def test_a_kvstore_without_a_layout_takes_the_one_a_worker_registers() -> None:
    """`kvmesh up` starts its store before the workers: the first worker's registration (its
    model, page size, KV dtype, KV spec key and page bytes) is the store's layout."""

    async def scenario(etcd: EtcdServer) -> None:
        stop = asyncio.Event()
        options = build(KVStoreConfig, etcd=etcd.endpoint, ram_mib=1, disk_mib=0, lease_ttl=2)
        task = asyncio.create_task(serve_kvstore(options, stop))
        try:
            async with Registry(etcd.endpoint) as registry:
                await asyncio.sleep(1.0)  # waiting for a worker: not registered yet
                assert await registry.list_workers("kvstore") == [] and not task.done()
                spec = "v1:2L:gqa:p32:bf16"
                worker = WorkerInfo(
                    "decode",
                    "d0",
                    "127.0.0.1:1",
                    model="tiny",
                    page_size=32,
                    kv_dtype="bf16",
                    capacity_tokens=64,
                    extra={"kv_spec": spec, "page_bytes": "8192"},
                )
                registration = await registry.register(worker, ttl=5)
                (info,) = await asyncio.wait_for(_until_registered(registry), 15)
                assert info.extra["layout_key"] == layout_key("tiny", 32, "bf16", spec)
                assert info.extra["page_bytes"] == 8192 and info.extra["ram_pages"] == 128
                await registration.close()
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)

    with EtcdServer() as etcd:
        run(scenario(etcd), timeout=45)


def test_a_kvstore_waiting_for_a_worker_stops_when_told() -> None:
    async def scenario(etcd: EtcdServer) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(serve_kvstore(build(KVStoreConfig, etcd=etcd.endpoint), stop))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task, 5)

    with EtcdServer() as etcd:
        run(scenario(etcd), timeout=30)
    with pytest.raises(InvalidRequestError, match="from the workers in etcd"):
        checked(build(KVStoreConfig))


class _NoTransfer:
    """Stands in for a transfer engine where a test only calls GetStats."""


def test_pages_of_sharded_pools_are_stored_whole_and_fetched_into_another_split(te: Engines):
    """A tensor-parallel worker's page is split by heads over its ranks' pools: the store gets
    (and digests) the whole page, and a worker of another split gets its heads back."""
    base, quarter = te.pool.data_ptr(), PAGE // 4  # pages of 4 heads of 1024 bytes

    def heads(address: int, first: int, count: int) -> PoolShard:
        return PoolShard(address, (range(first * quarter, (first + count) * quarter),))

    one_three = PoolLayout((heads(base, 0, 1), heads(base + 4 * PAGE, 1, 3)), PAGE)
    two_two = PoolLayout((heads(base + 16 * PAGE, 0, 2), heads(base + 24 * PAGE, 2, 2)), PAGE)
    whole = te.pool.view(-1)

    def page(side, i: int) -> bytes:
        return b"".join(whole[a - base : a - base + n].numpy().tobytes() for a, n in side.pieces(i))

    async def scenario() -> None:
        async with serving(te) as (store, client):
            src = one_three.side(range(4))
            assert await client.offer(HASHES[:4], src, PAGE, LAYOUT) == 4
            dst = two_two.side([3, 2, 1, 0])
            assert await client.fetch(HASHES[:4], dst, PAGE, LAYOUT) == 4
            assert [page(dst, i) for i in range(4)] == [page(src, i) for i in range(4)]
            slot = store.pages.ram.get(HASHES[1]).slot
            store.pages.ram.pool[slot, 3 * quarter + 5] ^= 0xFF  # in the second shard's heads
            assert await client.fetch(HASHES[:4], dst, PAGE, LAYOUT) == 1

    run(scenario())
