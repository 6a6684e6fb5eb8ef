"""Rank 0's side of a tensor-parallel engine: the other ranks' processes, a socket to each,
and the runner that sends them every forward pass.

Rank 0 runs the scheduler, the KV block manager and the sampler as a single engine does. Its
runner (`LeaderRunner`) sends each forward pass to the other ranks as plain data (the step
plans applied since the last pass, then the chunks to run) before running its own shard; the
ranks meet in the all-reduces inside the layers (gloo). A rank exits when its socket to rank 0
closes, which is also how it dies with rank 0 (whatever kills it); rank 0 stops them on
`close()` and at exit.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvmesh.engine.config import EngineConfig, ModelConfig
from kvmesh.engine.kv.layout import KVCacheSpec, spec_for_model
from kvmesh.engine.kv_cache import PagedKVCache
from kvmesh.engine.kv_pages import KvPages
from kvmesh.engine.parallel import group
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.parallel.shared_pages import new_region, pool_of, pool_offsets, send_region
from kvmesh.engine.parallel.shm_reduce import ShmAllReduce
from kvmesh.engine.runner import ModelRunner
from kvmesh.errors import EngineFailure
from kvmesh.mesh.processes import die_with_parent, stop_groups


class Ranks:
    """Ranks 1..world-1 of a tensor-parallel engine, started by rank 0 (this process)."""

    def __init__(self, config: EngineConfig, world: int, threads: int, capacity: int) -> None:
        """capacity: floats of the shared-memory all-reduce's slots."""
        self.world = world
        store = group.master_store(world)
        self.shm = ShmAllReduce(world, 0, capacity, alive=self._all_running)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        env = {**os.environ, "KVMESH_NUM_THREADS": str(threads)}
        try:
            for rank in range(1, world):
                ours, theirs = socket.socketpair()
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvmesh.engine.parallel.rank", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=die_with_parent(),
                ))  # fmt: skip
                theirs.close()
                self._conns.append(Connection(ours.detach()))
                self._conns[-1].send(("init", config, rank, world, store.port, self.shm.name))
            self.group = group.join(0, world, store)
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    def alive(self) -> bool:
        """Every rank runs and none was stopped (a failed pass stops them all)."""
        return self.shm is not None and self._all_running()

    def _all_running(self) -> bool:
        return all(proc.poll() is None for proc in self._procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def send(self, message: tuple[Any, ...]) -> None:
        if self.shm is None:
            raise EngineFailure("this engine's tensor-parallel ranks are stopped")
        for rank in range(1, self.world):
            self._send_to(rank, message)

    def share_pages(self, specs: list[KVCacheSpec], num_pages: int) -> tuple[torch.Tensor, list]:
        """Every rank's page pool (specs[r]: its heads) in one block of shared memory, which
        each rank maps: the block and each rank's pool in it (shared_pages.py)."""
        offsets, nbytes = pool_offsets(specs, num_pages)
        fd, region = new_region(nbytes)
        try:
            for rank in range(1, self.world):  # each its own offset: one message per rank
                self._send_to(rank, ("pages", num_pages, nbytes, offsets[rank]), fd)
        finally:
            os.close(fd)
        pools = [pool_of(region, o, s, num_pages) for o, s in zip(offsets, specs, strict=True)]
        return region, pools

    def kv_pool(self, model: ModelConfig, config: EngineConfig,
                dtype: torch.dtype) -> tuple[PagedKVCache, KvPages]:  # fmt: skip
        """Rank 0's page pool, and every rank's as one KvPages; the page count fits every
        rank's share of the budget (each its KV heads)."""
        shards = [TensorShard.of(config, r) for r in range(self.world)]
        kv_dtype = config.resolved_kv_dtype
        specs = [spec_for_model(s.local_config(model), config.page_size, kv_dtype) for s in shards]
        num_pages = config.num_pages or min(s.pages_for_budget(config.kv_cache_bytes)
                                            for s in specs)  # fmt: skip
        region, pools = self.share_pages(specs, num_pages)
        self._await_ready()
        cache = PagedKVCache(specs[0], num_pages, dtype, pool=pools[0])
        whole = spec_for_model(model, config.page_size, kv_dtype)
        heads = [s.kv_heads(model) for s in shards]
        return cache, KvPages(whole, pools, heads, region)

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
            self._conns[rank - 1].send(message)
            if fd is not None:
                send_region(self._conns[rank - 1], fd)
        except OSError as exc:  # the ranks before it got the pass: none may run it alone
            if message[0] == "pages":  # it failed before it took its pages: say why
                self._raise_failure(rank, exc)
            self.close()
            raise EngineFailure(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def close(self) -> None:
        """Stop the ranks (their sockets closed first: each exits on its own)."""
        for conn in self._conns:
            conn.close()
        self._conns = []
        stop_groups(self._procs, grace=5.0)
        self._procs = []
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        atexit.unregister(self.close)


def start_ranks(config: EngineConfig, loaded: Any, threads: int) -> Ranks:
    """The other ranks of a tensor-parallel engine whose rank 0 (this process) has `loaded`
    its shard, joined to rank 0's layers."""
    shard = TensorShard.of(config, 0)
    capacity = group.reduce_capacity(loaded.config, config.max_num_batched_tokens,
                                     config.max_num_seqs)  # fmt: skip
    ranks = Ranks(config, shard.world, threads, capacity)
    try:
        group.all_reduced_layers(loaded.model, shard.vocab(loaded.config), ranks.group, ranks.shm)
    except BaseException:
        ranks.close()  # (later failures: the ranks stop at exit, as registered)
        raise
    return ranks


class LeaderRunner(ModelRunner):
    """Rank 0's runner: what it applies is queued for the other ranks, and each forward pass
    is sent to them before its own shard runs (the same passes, in the same order)."""

    def __init__(self, model: Any, kv: Any, attention: Any, ranks: Ranks) -> None:
        super().__init__(model, kv, attention)
        self.ranks = ranks
        self._ops: list[tuple[str, Any]] = []
        self._every_row = False  # the pass's LM head: every row (a score) or the sampled ones

    def apply(self, plan: Any) -> None:
        self._ops.append(("apply", plan))
        super().apply(plan)

    def execute(self, chunks: Any) -> Any:
        return self._guarded(super().execute, chunks)

    def score_rows(self, plan: Any) -> Any:
        self._every_row = True
        try:
            return self._guarded(super().score_rows, plan)
        finally:
            self._every_row = False

    def _guarded(self, run: Any, arg: Any) -> Any:
        """A whole pass (its layers' and its LM head's sums): if it fails here, the other ranks
        may wait in a sum this rank will never reach, and matched calls cannot be restored, so
        the ranks stop and every later pass fails."""
        try:
            return run(arg)
        except EngineFailure:
            self.ranks.close()
            raise
        except BaseException as exc:
            self.ranks.close()
            raise EngineFailure(f"a tensor-parallel pass failed on rank 0: {exc}") from exc

    def score(self, plan: Any) -> Any:
        try:
            return super().score(plan)
        finally:
            self._ops.extend(("forget", chunk.req_id) for chunk in plan.chunks)

    def _forward(self, chunks: Any):
        ops, self._ops = self._ops, []
        self.ranks.send(("forward", ops, chunks, self._every_row))
        return super()._forward(chunks)
