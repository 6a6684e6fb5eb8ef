"""Every tensor-parallel rank's KV page pool in one block of anonymous shared memory (a memfd):
rank 0 makes it and hands its descriptor to the other ranks over their sockets, each rank uses
its own part as its pool, and rank 0 sees every part, so its transfer engine moves any rank's
pages (kv_pages.py). Nothing is named in /dev/shm: the memory goes with the last process that
maps it, however the ranks end. With --kv-hugepages the block is a hugetlb memfd of 2 MiB pages
(also for a worker of one process: `new_pool`)."""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.errors import HugePagesError

_ALIGN = 4096  # each rank's pool starts on a memory page
HUGEPAGE = 2 << 20
SYSFS_2MB = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")


def pool_offsets(specs: Sequence[KVCacheSpec], num_pages: int) -> tuple[list[int], int]:
    """Where each rank's pool starts in the block, and the block's size."""
    sizes = [-(-(num_pages + 2) * s.page_bytes // _ALIGN) * _ALIGN for s in specs]
    return list(itertools.accumulate([0, *sizes[:-1]])), sum(sizes)


def new_region(nbytes: int, hugepages: bool = False) -> tuple[int, torch.Tensor]:
    """A zeroed block of `nbytes` (committed now, not at first touch) and its descriptor; on
    2 MiB hugepages with `hugepages` (the block rounded up to whole ones: map all of it)."""
    if not hugepages:
        return _committed(os.memfd_create("kvmesh-kv-pages", os.MFD_CLOEXEC), nbytes)
    size = -(-nbytes // HUGEPAGE) * HUGEPAGE
    try:
        fd = os.memfd_create("kvmesh-kv-pages", os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_HUGE_2MB)
        return _committed(fd, size)
    except OSError as exc:  # none reserved or free (ENOSPC / ENOMEM), or no hugetlbfs
        raise HugePagesError.short_of(size // HUGEPAGE, exc) from exc


def obtainable_hugepages(root: Path = SYSFS_2MB) -> int | None:
    """2 MiB pages a new mapping could get on this machine: free and unreserved, plus surplus
    the kernel may still make (vm.nr_overcommit_hugepages); None where the kernel does not say.
    A container's hugetlb limit may allow fewer."""
    try:
        read = {
            name: int((root / f"{name}_hugepages").read_text())
            for name in ("free", "resv", "nr_overcommit", "surplus")
        }
    except (OSError, ValueError):
        return None
    return read["free"] - read["resv"] + max(0, read["nr_overcommit"] - read["surplus"])


def require_hugepages(root: Path = SYSFS_2MB) -> None:
    """Fail before a long model load where the machine has no 2 MiB hugepage to give at all
    (the pool's own allocation says when there are too few)."""
    if obtainable_hugepages(root) == 0:
        raise HugePagesError.none_free()


def _committed(fd: int, size: int) -> tuple[int, torch.Tensor]:
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return fd, map_region(fd, size)
    except BaseException:
        os.close(fd)
        raise


def new_pool(spec: KVCacheSpec, num_pages: int, hugepages: bool) -> torch.Tensor:
    """One process's zeroed page pool (with its 2 spare rows) in a block of its own."""
    _, nbytes = pool_offsets([spec], num_pages)
    fd, region = new_region(nbytes, hugepages)
    os.close(fd)  # the mapping keeps the memory
    return pool_of(region, 0, spec, num_pages)


def map_region(fd: int, nbytes: int) -> torch.Tensor:
    """The block behind `fd` as a uint8 tensor (the mapping lives as long as the tensor)."""
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)


def pool_of(region: torch.Tensor, offset: int, spec: KVCacheSpec, num_pages: int) -> torch.Tensor:
    rows = num_pages + 2
    return region[offset : offset + rows * spec.page_bytes].view(rows, spec.page_bytes)


def send_region(conn: Connection, fd: int) -> None:
    reduction.send_handle(conn, fd, 0)  # (the pid is unused on POSIX)


def receive_region(conn: Connection, nbytes: int) -> torch.Tensor:
    fd = reduction.recv_handle(conn)
    try:
        return map_region(fd, nbytes)
    finally:
        os.close(fd)
