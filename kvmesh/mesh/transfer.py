"""KV page transfer between workers' page pools with the Mooncake Transfer Engine (TE).

A prefill worker writes pages straight into a decode worker's registered pool; bytes never go
through gRPC. One page is one contiguous byte range (see `kvmesh.engine.pool.kv_cache`), so a transfer
is a list of (local address, remote address, length) segments in one batch call.

Measured behaviour of mooncake-transfer-engine 0.3.13 (TCP, loopback) that shapes this module:
- The TE calls release the GIL: a Python thread keeps running during a write, so `write_pages`
  may be called from a worker thread while the event loop or the model runs.
- Concurrent calls from several threads on one engine work, but the TCP transport queues at most
  ~2048 entries per peer. A batch past that fails (rc -1), and concurrent batches past it time out
  after `MC_TRANSFER_TIMEOUT` (30 s). Either way the (initiator, peer) pair then stays broken for
  good. Hence batches of at most `MAX_BATCH_ENTRIES` and at most `MAX_INFLIGHT_BATCHES` in flight.
- A remote range outside the peer's registered memory, or a peer that is not listening, gives
  rc -1 within milliseconds and leaves the pair usable.
- A write that timed out (hung peer) can still land later: treat the destination pages as dirty.
- Destroying an engine takes ~1 s; `close()` does it once. In a process whose CLI said it
  ends after serving (`end_with_process`), `close()` skips that and the CLI exits through
  `processes.exit_now`: the process's end closes what the engine held.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import structlog

from kvmesh.config.placement import PROTOCOLS
from kvmesh.errors import TransferError

log = structlog.get_logger(__name__)

MAX_BATCH_ENTRIES = 256  # entries per TE batch call (the TCP per-peer queue holds ~2048)
MAX_INFLIGHT_BATCHES = 4  # batches in flight per engine, over all threads and peers
_PARKED: list[Any] = []  # engines `close` left undestroyed: the process exits next
_ENDS_WITH_PROCESS = [False]  # set by the CLI (`end_with_process`), never by a library caller


def end_with_process() -> None:
    """This process exits right after its service stops (`kvmesh serve`): from now on `close`
    leaves a P2P engine for the process's end to close instead of its ~1 s destructor."""
    _ENDS_WITH_PROCESS[0] = True


def parked() -> bool:
    """Whether `close` left an engine for the process's exit to end (see `end_with_process`)."""
    return bool(_PARKED)


@dataclass(frozen=True)
class TransferConfig:
    """How this worker's transfer engine joins the mesh.

    `metadata_server` is "P2PHANDSHAKE" (no metadata service; peers address each other as
    "host:rpc_port"), "etcd://host:port" or "http://host:port/metadata". `device` names RDMA NICs
    (empty for TCP).
    """

    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    hostname: str = "127.0.0.1"
    device: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not self.metadata_server:
            raise ValueError("metadata_server must not be empty")
        if not self.hostname:
            raise ValueError("hostname must not be empty")
        if self.device and self.protocol != "rdma":
            raise ValueError(
                f"RDMA devices ({self.device}) need protocol rdma, not {self.protocol}"
            )


class Segments(NamedTuple):
    """Byte ranges to move: src[i] -> dst[i], lengths[i] bytes each."""

    src: list[int]
    dst: list[int]
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


def page_segments(pool_address: int, page_bytes: int, page_ids: Sequence[int]) -> list[int]:
    """Start address of each page in a pool laid out as [page, ...] contiguous pages."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    return [pool_address + page_id * page_bytes for page_id in page_ids]


def coalesce(src: Sequence[int], dst: Sequence[int], length: int | Sequence[int]) -> Segments:
    """Merge neighbouring entries whose src and dst ranges both continue the previous one."""
    lengths = _lengths(length, len(src))
    if len(dst) != len(src):
        raise ValueError(f"{len(src)} source but {len(dst)} destination addresses")
    out = Segments([], [], [])
    for s, d, n in zip(src, dst, lengths, strict=True):
        if out.src and out.src[-1] + out.lengths[-1] == s and out.dst[-1] + out.lengths[-1] == d:
            out.lengths[-1] += n
        else:
            out.src.append(s)
            out.dst.append(d)
            out.lengths.append(n)
    return out


def _lengths(length: int | Sequence[int], count: int) -> list[int]:
    lengths = [length] * count if isinstance(length, int) else list(length)
    if len(lengths) != count:
        raise ValueError(f"{count} addresses but {len(lengths)} lengths")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    return lengths


def _chunks(segments: Segments, size: int) -> Iterator[Segments]:
    for i in range(0, len(segments.src), size):
        part = slice(i, i + size)
        yield Segments(segments.src[part], segments.dst[part], segments.lengths[part])


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send fd 2 to /dev/null (Mooncake's glog writes there directly during init).

    fd 2 is process-wide: anything another thread writes to stderr meanwhile is lost too.
    """
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _prepare_env(hostname: str) -> None:
    # Read by the engine at initialize(): the address it advertises (a service's
    # --advertise-host, else its --host), unless the operator says otherwise.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _new_engine(config: TransferConfig) -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError("mooncake-transfer-engine is not installed") from exc
    _prepare_env(config.hostname)
    engine = TransferEngine()
    with _quiet_stderr():
        rc = engine.initialize(
            config.hostname, config.metadata_server, config.protocol, config.device
        )
    if rc != 0:
        raise TransferError(
            f"transfer engine initialize failed (rc={rc}, metadata={config.metadata_server!r}, "
            f"protocol={config.protocol})"
        )
    return engine


class KvTransferEngine:
    """One Mooncake TE per worker: registers the KV pool and moves pages to and from peers.

    Thread-safe: calls may come from several threads (in-flight batches are bounded).
    """

    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self._engine: Any = _new_engine(self.config)
        self._registered: dict[int, int] = {}
        self._inflight = threading.BoundedSemaphore(MAX_INFLIGHT_BATCHES)
        self._lock = threading.Lock()
        log.info("transfer_engine_started", session=self.session, protocol=self.config.protocol)

    @property
    def session(self) -> str:
        """The id peers pass as `session` to reach this engine ("host:rpc_port" in P2P mode)."""
        if self.config.metadata_server == "P2PHANDSHAKE":
            return f"{self.config.hostname}:{self._live().get_rpc_port()}"
        return self.config.hostname

    def register(self, address: int, nbytes: int) -> None:
        """Expose [address, address + nbytes) to peers. Keep the memory alive and unmoved."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        with self._lock:
            if address in self._registered:
                raise TransferError(f"address {address:#x} is already registered")
            rc = self._live().register_memory(address, nbytes)
            if rc != 0:
                raise TransferError(f"register_memory({address:#x}, {nbytes}) failed (rc={rc})")
            self._registered[address] = nbytes

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is None:
                raise TransferError(f"address {address:#x} is not registered")
            rc = self._live().unregister_memory(address)
        if rc != 0:
            raise TransferError(f"unregister_memory({address:#x}) failed (rc={rc})")

    def write_pages(
        self,
        session: str,
        src: Sequence[int],
        dst: Sequence[int],
        length: int | Sequence[int],
    ) -> int:
        """Copy local ranges src[i] into the peer's registered ranges dst[i]; returns bytes moved.

        `length` is one length for every entry or one per entry. Runs where both sides are
        contiguous are merged first. Blocks until done; raises TransferError on any failure
        (some entries may have landed).
        """
        return self._transfer("write", session, coalesce(src, dst, length))

    def read_pages(
        self,
        session: str,
        src: Sequence[int],
        dst: Sequence[int],
        length: int | Sequence[int],
    ) -> int:
        """Copy the peer's registered ranges src[i] into local ranges dst[i]; returns bytes."""
        return self._transfer("read", session, coalesce(src, dst, length))

    def close(self) -> None:
        """Destroy the engine (takes ~1 s), or park it when the process ends next
        (`end_with_process`; P2P mode only: with a metadata server the destructor also removes
        this engine's records there). Idempotent; later calls raise TransferError."""
        with self._lock:
            engine, self._engine = self._engine, None
            self._registered.clear()
        if engine is None:
            return
        session = f"{self.config.hostname}:{engine.get_rpc_port()}"
        if _ENDS_WITH_PROCESS[0] and self.config.metadata_server == "P2PHANDSHAKE":
            _PARKED.append(engine)
            log.info("transfer_engine_parked", session=session)
            return
        del engine
        log.info("transfer_engine_closed", session=session)

    def __enter__(self) -> KvTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> Any:
        engine = self._engine
        if engine is None:
            raise TransferError("transfer engine is closed")
        return engine

    def _transfer(self, op: str, session: str, segments: Segments) -> int:
        for part in _chunks(segments, MAX_BATCH_ENTRIES):
            rc = self._batch(op, session, part)
            if rc != 0:
                log.warning("kv_transfer_failed", op=op, peer=session, rc=rc)
                raise TransferError(
                    f"KV {op} with peer {session} failed (rc={rc}): batch of "
                    f"{len(part.src)} of {len(segments.src)} segments, {part.nbytes} of "
                    f"{segments.nbytes} bytes"
                )
        return segments.nbytes

    def _batch(self, op: str, session: str, part: Segments) -> int:
        engine = self._live()
        call = (
            engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read
        )
        # For a read, the TE's "local" list is our destination and "remote" our source.
        local, remote = (part.src, part.dst) if op == "write" else (part.dst, part.src)
        with self._inflight:
            return call(session, local, remote, part.lengths)
