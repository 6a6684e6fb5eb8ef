"""This process's resident memory, for measuring what a model load costs.

The peak is /proc's VmHWM (per address space, so it starts afresh at exec); VmRSS counts anonymous and file-backed
pages mapped now (a mapped file's touched pages count, page cache that is not mapped does not).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys
from collections.abc import Callable
from pathlib import Path


def peak_rss_bytes() -> int:
    """The most this process has had resident since it started (never decreases): VmHWM of
    /proc/self/status. Not `ru_maxrss`, which Linux carries across execve: a process started by
    a large parent (pytest after many tests) reports the parent's peak from its first line."""
    peak = _status_bytes("VmHWM:")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def current_rss_bytes() -> int | None:
    """Resident now (VmRSS of /proc/self/status); None where /proc is not there."""
    return _status_bytes("VmRSS:")


def process_memory_mib(pid: int | str = "self") -> dict[str, float]:
    """A process's resident memory by kind, MiB: private (RssAnon), shared memory it maps
    (RssShmem: a tensor-parallel worker's KV pages), mapped files (RssFile: checkpoint pages)
    and its peak so far (VmHWM: a load's transient). Empty where /proc is not there or the
    process is gone."""
    out = {}
    for kind in ("RssAnon", "RssShmem", "RssFile", "VmHWM"):
        value = _status_bytes(f"{kind}:", pid)
        if value is not None:
            out[kind.lower()] = round(value / 2**20, 1)
    return out


def _status_bytes(field: str, pid: int | str = "self") -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release_freed_memory() -> None:
    """Hands memory that is free inside the C heap back to the OS (glibc's `malloc_trim`; a
    no-op elsewhere). glibc keeps freed blocks under its mmap threshold -- which rises to 32 MB
    as large blocks are freed -- mapped, so a load that converts tensor after tensor leaves
    holes that count as RSS unless they are returned (peak RSS while loading:
    docs/benchmarks.md, "INT4 weights")."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
