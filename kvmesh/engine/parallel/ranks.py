"""Rank 0's side of a parallel engine: the other ranks' processes, a socket to each, their
page pools, and the runner that sends them every forward pass.

Rank 0 runs the scheduler, the KV block manager and the sampler as a single engine does. Its
runner (`LeaderRunner`, leader.py) sends each forward pass to the other ranks as plain data
(the step plans applied since the last pass, then the chunks to run) before running its own
shard; the ranks meet in the all-reduces inside the layers (the platform's group: gloo, NCCL on
GPUs). Every rank's pool is its part of one shared host block, or, with staged transfers (GPU
pools), its own, mirrored by that part and copied when rank 0 asks (`stage`). A rank exits when
its socket to rank 0 closes, which is also how it dies with rank 0 (whatever kills it); rank 0
stops them on `close()` and at exit.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.config import ModelConfig, spec_for_model
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.kv.pool_layout import shard_spans
from kvmesh.engine.parallel import group
from kvmesh.engine.parallel.pipeline import Pipeline
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.parallel.shared_pages import new_region, pool_of, pool_offsets, send_region
from kvmesh.engine.parallel.shm_reduce import ShmAllReduce
from kvmesh.engine.platform import Platform
from kvmesh.engine.platform.groups import master_store
from kvmesh.engine.pool.kv_cache import PagedKVCache
from kvmesh.engine.pool.kv_pages import KvPages, StagedKvPages
from kvmesh.errors import EngineFailure
from kvmesh.processes import die_with_parent, stop_groups


class Ranks:
    """Ranks 1..world-1 of a parallel engine (tensor x pipeline), started by rank 0 (this
    process)."""

    def __init__(
        self, config: EngineConfig, threads: int, capacity: int, platform: Platform
    ) -> None:
        """capacity: floats of a shared-memory all-reduce's slots; platform: rank 0's."""
        tp, stages = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        self.world, self._stopped, self.platform = config.parallel.world_size, False, platform
        self._closing = threading.Lock()  # close() may come from two threads (a lost engine)
        self._sending = threading.Lock()  # passes (engine thread) and staging (service threads)
        self._staging = threading.Lock()  # one staging at a time: its answers read in order
        self.sums: list[ShmAllReduce] = []
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        env = {**os.environ, "KVMESH_NUM_THREADS": str(threads)}
        try:
            store = master_store(self.world)
            # one shared-memory all-reduce per stage's tensor-parallel ranks, all made by rank 0
            for _ in range(stages if tp > 1 and platform.sums_in_shared_memory else 0):
                self.sums.append(ShmAllReduce(tp, 0, capacity, alive=self._all_running))
            for rank in range(1, self.world):
                ours, theirs = socket.socketpair()
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "kvmesh.engine.parallel.rank", str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),),
                        env=env,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=die_with_parent(),
                    )
                )
                theirs.close()
                self._conns.append(Connection(ours.detach()))
                self._conns[-1].send(
                    ("init", config, rank, store.port, [s.name for s in self.sums])
                )
            join = platform.join_group
            self.group = join(0, self.world, store)  # pipeline links; TP's without stages
            self.tp_group = self.group if stages == 1 or tp == 1 else join(0, tp, store, "stage0")
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    def alive(self) -> bool:
        """Every rank runs and none was stopped (a failed pass stops them all)."""
        return not self._stopped and self._all_running()

    def running(self) -> bool:
        """Every other rank's process runs (what a rank 0 waiting on them polls)."""
        return self._all_running()

    @property
    def shm(self) -> ShmAllReduce | None:
        """Rank 0's stage's shared-memory all-reduce (None without tensor parallelism)."""
        return self.sums[0] if self.sums else None

    def _all_running(self) -> bool:
        return all(proc.poll() is None for proc in self._procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def send(self, message: tuple[Any, ...]) -> None:
        if self._stopped:
            raise EngineFailure("this engine's parallel ranks are stopped")
        for rank in range(1, self.world):
            self._send_to(rank, message)

    def share_pages(
        self, specs: list[KVCacheSpec], num_pages: int, hugepages: bool, staged: bool
    ) -> tuple[torch.Tensor, list]:
        """One block of shared memory that each rank maps, holding every rank's pool (specs[r]:
        its heads) or, `staged`, a host mirror of each rank's own (GPU) pool: the block and
        each rank's part (shared_pages.py; on hugepages with `hugepages`)."""
        offsets, nbytes = pool_offsets(specs, num_pages)
        fd, region = new_region(nbytes, hugepages)
        try:
            for rank in range(1, self.world):  # each its own offset: one message per rank
                message = ("pages", num_pages, region.numel(), offsets[rank], staged)
                self._send_to(rank, message, fd)
        finally:
            os.close(fd)
        parts = [pool_of(region, o, s, num_pages) for o, s in zip(offsets, specs, strict=True)]
        return region, parts

    def kv_pool(
        self, model: ModelConfig, config: EngineConfig, dtype: torch.dtype
    ) -> tuple[PagedKVCache, KvPages]:
        """Rank 0's page pool, and every rank's as one KvPages; the page count fits every
        rank's share of the budget (each its KV heads)."""
        shards = [TensorShard.of(config, r) for r in range(self.world)]
        kv_dtype = config.resolved_kv_dtype
        specs = [
            spec_for_model(s.local_config(model), config.cache.page_size, kv_dtype) for s in shards
        ]
        budget = self.platform.kv_budget(config.cache.kv_cache_bytes)  # each GPU's like rank 0's
        num_pages = config.cache.num_pages or min(s.pages_for_budget(budget) for s in specs)
        staged = self.platform.kv_transfer(config.device.kv_transfer) == "staged"
        region, parts = self.share_pages(specs, num_pages, config.cache.kv_hugepages, staged)
        self._await_ready()
        whole = spec_for_model(model, config.cache.page_size, kv_dtype)
        spans = [shard_spans(whole, s.kv_heads(model), s.layers(model)) for s in shards]
        if not staged:
            cache = PagedKVCache(specs[0], num_pages, dtype, pool=parts[0])
            return cache, KvPages(whole, parts, spans, region)
        pool = self.platform.new_pool(specs[0], num_pages, False)
        cache = PagedKVCache(specs[0], num_pages, dtype, pool=pool)
        return cache, StagedKvPages(whole, pool, parts, spans, region, self.stage)

    def stage(self, direction: str, pages: list[int]) -> None:
        """Ranks 1.. copy `pages` between their own pools and their parts of the shared block
        ("out": pool -> block, "in": block -> pool), each after the passes sent before; back
        when all have."""
        with self._staging:
            for rank in range(1, self.world):
                self._send_to(rank, ("stage", direction, pages))
            for rank in range(1, self.world):
                try:
                    answer = self._conns[rank - 1].recv()
                except (EOFError, OSError) as exc:
                    raise EngineFailure(f"parallel rank {rank} is gone: {exc}") from exc
                if answer[0] != "staged":
                    raise EngineFailure(f"parallel rank {rank} could not stage pages: {answer}")

    def _await_ready(self) -> None:
        """Each rank's word that its shard is built; a rank that failed sends its exception,
        raised here as rank 0's own (the ranks stopped)."""
        for rank in range(1, self.world):
            self._raise_failure(rank)

    def _raise_failure(self, rank: int, cause: BaseException | None = None) -> None:
        """Wait for rank `rank`'s ("ready",) or ("failed", exc); raise exc if it failed."""
        try:
            message = self._conns[rank - 1].recv()
        except (EOFError, OSError):
            message = ("gone",)
        if message[0] == "ready":
            return
        self.close()
        if message[0] == "failed":
            raise message[1]
        raise EngineFailure(f"tensor-parallel rank {rank} ended while it loaded") from cause

    def _send_to(self, rank: int, message: tuple[Any, ...], fd: int | None = None) -> None:
        """To one rank (with the descriptor `fd`, where given)."""
        try:
            with self._sending:
                self._conns[rank - 1].send(message)
                if fd is not None:
                    send_region(self._conns[rank - 1], fd)
        except OSError as exc:  # the ranks before it got the pass: none may run it alone
            if message[0] == "pages":  # it failed before it took its pages: say why
                self._raise_failure(rank, exc)
            self.close()
            raise EngineFailure(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def close(self) -> None:
        """Stop the ranks (their sockets closed first: each exits on its own). Once, from
        whichever thread comes first; a pass still running fails (sends to closed sockets,
        sums whose peers are gone)."""
        with self._closing:
            if self._stopped and not self._procs:
                return
            self._stopped = True
            for conn in self._conns:
                conn.close()
            stop_groups(self._procs, grace=5.0)
            self._procs = []
            for block in self.sums:
                block.close()
            atexit.unregister(self.close)


def join_shard(
    model: Any,
    config: ModelConfig,
    shard: TensorShard,
    world: Any,
    tp: Any,
    shm: ShmAllReduce | None,
    alive: Any,
) -> None:
    """A rank's model joined to the others: its stage's tensor-parallel sums, its stage's links
    (`alive`: whether the ranks it may wait on still run)."""
    if shard.world > 1:
        group.all_reduced_layers(model, shard.vocab(config), tp, shm)
    if shard.stages > 1:
        Pipeline(model, shard, world, alive).install()


def start_ranks(config: EngineConfig, loaded: Any, threads: int, platform: Platform) -> Ranks:
    """The other ranks of a tensor-parallel engine whose rank 0 (this process, on `platform`)
    has `loaded` its shard, joined to rank 0's layers."""
    shard = TensorShard.of(config, 0)
    capacity = group.reduce_capacity(
        loaded.config, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs
    )
    ranks = Ranks(config, threads, capacity, platform)
    try:
        join_shard(
            loaded.model,
            loaded.config,
            shard,
            ranks.group,
            ranks.tp_group,
            ranks.shm,
            ranks.running,
        )
    except BaseException:
        ranks.close()  # (later failures: the ranks stop at exit, as registered)
        raise
    return ranks
