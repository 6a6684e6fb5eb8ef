"""KvTransferEngine over TCP on loopback: two engines in one process, small KV-shaped pools."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("mooncake.engine")

from kvmesh.mesh.transfer import (  # noqa: E402
    KvTransferEngine,
    TransferConfig,
    TransferError,
    coalesce,
    page_segments,
)

NUM_PAGES = 32
POOL_SHAPE = (NUM_PAGES, 2, 2, 4, 2, 8)  # [page, layer, k|v, slot, head, dim]


@dataclass
class Pair:
    prefill: KvTransferEngine
    decode: KvTransferEngine
    src_pool: torch.Tensor
    dst_pool: torch.Tensor

    @property
    def page_bytes(self) -> int:
        return self.src_pool[0].numel() * self.src_pool.element_size()

    def src_pages(self, ids: list[int]) -> list[int]:
        return page_segments(self.src_pool.data_ptr(), self.page_bytes, ids)

    def dst_pages(self, ids: list[int]) -> list[int]:
        return page_segments(self.dst_pool.data_ptr(), self.page_bytes, ids)


@pytest.fixture(scope="module")
def pair():
    prefill, decode = KvTransferEngine(), KvTransferEngine(TransferConfig())
    src_pool = torch.randn(POOL_SHAPE)
    dst_pool = torch.zeros(POOL_SHAPE)
    nbytes = dst_pool.numel() * dst_pool.element_size()
    prefill.register(src_pool.data_ptr(), nbytes)
    decode.register(dst_pool.data_ptr(), nbytes)
    yield Pair(prefill, decode, src_pool, dst_pool)
    prefill.close()  # ~1 s each (TE destruction); overlapping them in threads saves nothing
    decode.close()


@pytest.fixture
def fresh(pair: Pair) -> Pair:
    pair.dst_pool.zero_()
    return pair


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="protocol"):
        TransferConfig(protocol="udp")
    assert TransferConfig(protocol="rdma").protocol == "rdma"


def test_bind_address_is_loopback_after_construction(pair: Pair) -> None:
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert pair.decode.session.startswith("127.0.0.1:")
    assert pair.decode.session != pair.prefill.session


def test_page_segments() -> None:
    assert page_segments(1000, 10, [0, 3, 1]) == [1000, 1030, 1010]


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    src = page_segments(0, 10, [0, 1, 2, 5, 6, 9])
    dst = page_segments(1000, 10, [4, 5, 9, 2, 3, 7])
    segs = coalesce(src, dst, 10)
    assert segs.src == [0, 20, 50, 90]
    assert segs.dst == [1040, 1090, 1020, 1070]
    assert segs.lengths == [20, 10, 20, 10]
    assert segs.nbytes == 60
    assert coalesce([0, 5], [0, 5], [5, 7]).lengths == [12]
    with pytest.raises(ValueError):
        coalesce([0, 1], [0], 1)


def test_scattered_write_touches_only_target_pages(fresh: Pair) -> None:
    gen = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(NUM_PAGES, generator=gen)[:9].tolist()
    dst_ids = torch.randperm(NUM_PAGES, generator=gen)[:9].tolist()
    written = fresh.prefill.write_pages(
        fresh.decode.session, fresh.src_pages(src_ids), fresh.dst_pages(dst_ids), fresh.page_bytes
    )
    assert written == 9 * fresh.page_bytes
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(fresh.dst_pool[d], fresh.src_pool[s])
    untouched = [p for p in range(NUM_PAGES) if p not in dst_ids]
    assert not fresh.dst_pool[untouched].any()


def test_coalesced_runs_give_fewer_segments_and_same_bytes(fresh: Pair) -> None:
    src_ids = [3, 4, 5, 6, 10, 11, 20]
    dst_ids = [12, 13, 14, 15, 0, 1, 30]
    src, dst = fresh.src_pages(src_ids), fresh.dst_pages(dst_ids)
    assert len(coalesce(src, dst, fresh.page_bytes).src) == 3
    written = fresh.prefill.write_pages(fresh.decode.session, src, dst, fresh.page_bytes)
    assert written == len(src_ids) * fresh.page_bytes
    assert torch.equal(fresh.dst_pool[dst_ids], fresh.src_pool[src_ids])
    untouched = [p for p in range(NUM_PAGES) if p not in dst_ids]
    assert not fresh.dst_pool[untouched].any()


def test_read_pages_pulls_from_peer(fresh: Pair) -> None:
    fresh.dst_pool[[7, 8]] = 1.5
    local = torch.zeros(2, *POOL_SHAPE[1:])
    read = fresh.prefill.read_pages(
        fresh.decode.session,
        fresh.dst_pages([7, 8]),
        page_segments(local.data_ptr(), fresh.page_bytes, [0, 1]),
        fresh.page_bytes,
    )
    assert read == 2 * fresh.page_bytes
    assert torch.equal(local, fresh.dst_pool[[7, 8]])


def test_peer_not_listening_fails_fast(pair: Pair) -> None:
    start = time.perf_counter()
    with pytest.raises(TransferError, match="127.0.0.1:1") as info:
        pair.prefill.write_pages("127.0.0.1:1", pair.src_pages([0]), [4096], pair.page_bytes)
    assert time.perf_counter() - start < 3.0
    assert info.value.code == "kv_transfer_failed"


def test_write_beyond_registered_range_fails_and_pair_stays_usable(fresh: Pair) -> None:
    beyond = fresh.dst_pages([NUM_PAGES - 1, NUM_PAGES])
    with pytest.raises(TransferError, match="2 segments"):
        fresh.prefill.write_pages(
            fresh.decode.session, fresh.src_pages([0, 5]), beyond, fresh.page_bytes
        )
    written = fresh.prefill.write_pages(
        fresh.decode.session, fresh.src_pages([2]), fresh.dst_pages([2]), fresh.page_bytes
    )
    assert written == fresh.page_bytes
    assert torch.equal(fresh.dst_pool[2], fresh.src_pool[2])


def test_double_registration_is_rejected(pair: Pair) -> None:
    nbytes = pair.dst_pool.numel() * pair.dst_pool.element_size()
    with pytest.raises(TransferError, match="already registered"):
        pair.decode.register(pair.dst_pool.data_ptr(), nbytes)


def test_large_batches_are_chunked(fresh: Pair) -> None:
    # 600 non-adjacent 16-byte entries: more than one TE batch, none merged.
    offsets = [i * 32 for i in range(600)]
    src = [fresh.src_pool.data_ptr() + o for o in offsets]
    dst = [fresh.dst_pool.data_ptr() + o for o in offsets]
    assert fresh.prefill.write_pages(fresh.decode.session, src, dst, 16) == 600 * 16
    src_bytes = fresh.src_pool.view(-1).view(torch.uint8)[: 600 * 32].view(600, 32)
    dst_bytes = fresh.dst_pool.view(-1).view(torch.uint8)[: 600 * 32].view(600, 32)
    assert torch.equal(dst_bytes[:, :16], src_bytes[:, :16])
    assert not dst_bytes[:, 16:].any()


def test_read_tags_sees_a_page_rewritten_after_its_reservation(pair: Pair) -> None:
    """What a prefill worker does after importing pages the decode worker holds: read their
    tags back (after the bytes) and compare with the tags they were reserved with."""
    from kvmesh.engine.pool.integrity import as_int32
    from services.prefill.worker import read_tags

    decode_tags = as_int32([7, 0xFFFFFFF0, 42, 9]).clone()  # int32 bit patterns, as in a pool
    staging = torch.zeros(4, dtype=torch.int32)
    pair.decode.register(decode_tags.data_ptr(), 16)
    pair.prefill.register(staging.data_ptr(), 16)
    try:
        session, address = pair.decode.session, decode_tags.data_ptr()
        reserved = as_int32([0xFFFFFFF0, 9]).tolist()
        assert read_tags(pair.prefill, session, address, [1, 3], staging) == reserved
        decode_tags[3] = 10  # a stale writer's tag landed on page 3
        assert read_tags(pair.prefill, session, address, [1, 3], staging) != reserved
    finally:
        pair.decode.unregister(decode_tags.data_ptr())
        pair.prefill.unregister(staging.data_ptr())


def test_each_shard_of_a_destination_is_reached_through_its_own_session(fresh: Pair) -> None:
    """A destination whose two shards (each half of every page) registered their pools with
    two transfer engines: written and read back through one call per shard's session."""
    from kvmesh.engine.kv.pool_layout import PageSide
    from kvmesh.mesh.page_copies import read_from, write_to
    from kvmesh.proto.v1 import prefill_pb2

    page, half = fresh.page_bytes, fresh.page_bytes // 2
    other = torch.zeros(NUM_PAGES, half, dtype=torch.uint8)
    with KvTransferEngine() as rank1:
        rank1.register(other.data_ptr(), other.numel())
        dest = prefill_pb2.KvDestination(
            te_session=fresh.decode.session,
            page_bytes=page,
            shards=[
                prefill_pb2.KvShard(address=fresh.dst_pool.data_ptr(), starts=[0], stops=[half]),
                prefill_pb2.KvShard(
                    address=other.data_ptr(), starts=[half], stops=[page], te_session=rank1.session
                ),
            ],
        )
        src = fresh.src_pool.view(NUM_PAGES, -1).view(torch.uint8)
        assert (
            write_to(fresh.prefill, PageSide.whole(fresh.src_pages([1, 2]), page), dest, [3, 5])
            == 2 * page
        )
        shard0 = fresh.dst_pool.view(-1).view(torch.uint8)[: NUM_PAGES * half].view(NUM_PAGES, half)
        for src_page, dst_page in ((1, 3), (2, 5)):
            assert torch.equal(shard0[dst_page], src[src_page, :half])
            assert torch.equal(other[dst_page], src[src_page, half:])
        local = PageSide.whole(fresh.src_pages([7, 8]), page)
        assert read_from(fresh.prefill, dest, [3, 5], local) == 2 * page
        assert torch.equal(src[7], src[1]) and torch.equal(src[8], src[2])


def test_close_parks_the_engine_only_in_a_process_that_ends_next() -> None:
    """A library caller's `close` destroys its engine; after the CLI's `end_with_process`
    (`kvmesh serve`) `close` parks it instead, for the process's exit to end."""
    import subprocess
    import sys

    script = (
        "from kvmesh.mesh import transfer\n"
        "e = transfer.KvTransferEngine(); e.close(); assert not transfer.parked()\n"
        "transfer.end_with_process()\n"
        "e = transfer.KvTransferEngine(); e.close(); assert transfer.parked()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "ok" and "transfer_engine_parked" in done.stdout
