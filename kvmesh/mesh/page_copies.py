"""Pages copied between this worker's pool and a peer's destination (KvDestination), each
remote shard through its own transfer session (a rank that registers its own pool: KvShard's
te_session; the destination's te_session otherwise): one transfer call per remote session."""

from __future__ import annotations

from kvmesh.engine.kv.pool_layout import PageSide, copy_ranges_by_shard
from kvmesh.mesh.convert import destination_side, shard_sessions
from kvmesh.mesh.transfer import KvTransferEngine
from kvmesh.proto.v1 import prefill_pb2


def write_to(
    transfer: KvTransferEngine,
    local: PageSide,
    dest: prefill_pb2.KvDestination,
    pages: list[int],
) -> int:
    """`local` pages written into the destination's `pages`; bytes moved."""
    return _copy(transfer, local, dest, pages, write=True)


def read_from(
    transfer: KvTransferEngine,
    dest: prefill_pb2.KvDestination,
    pages: list[int],
    local: PageSide,
) -> int:
    """The destination's `pages` read into `local` pages; bytes moved."""
    return _copy(transfer, local, dest, pages, write=False)


def _copy(
    transfer: KvTransferEngine,
    local: PageSide,
    dest: prefill_pb2.KvDestination,
    pages: list[int],
    write: bool,
) -> int:
    sessions, moved = shard_sessions(dest), 0
    remote = destination_side(dest, pages)
    src, dst = (local, remote) if write else (remote, local)
    call = transfer.write_pages if write else transfer.read_pages
    for shard, ranges in copy_ranges_by_shard(src, dst, "dst" if write else "src").items():
        moved += call(sessions[shard], *ranges)
    return moved
