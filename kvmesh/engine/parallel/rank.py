"""A tensor-parallel rank other than 0 (`python -m kvmesh.engine.parallel.rank FD`): joins the
worker's group, builds its shard of the model and KV pages (on its own GPU under --device
cuda), then runs every forward pass rank 0 sends over the socket FD, and copies pages between
its pool and the shared block when rank 0 asks (staged transfers), until the socket closes."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from kvmesh import env
from kvmesh.engine.attention import get_backend
from kvmesh.engine.core.engine_setup import TORCH_DTYPES, load_engine_model
from kvmesh.engine.loader import load_weights
from kvmesh.engine.parallel import group
from kvmesh.engine.parallel.ranks import join_shard
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.parallel.shared_pages import pool_of, receive_region
from kvmesh.engine.parallel.shm_reduce import ShmAllReduce
from kvmesh.engine.platform import resolve
from kvmesh.engine.platform.groups import client_store
from kvmesh.engine.pool.kv_cache import PagedKVCache
from kvmesh.engine.pool.kv_pages import copy_runs
from kvmesh.engine.runner.runner import ModelRunner, RunnerOptions


class FollowerRunner(ModelRunner):
    """Applies what rank 0 applied and runs its passes, the LM head's too (its part of the
    vocabulary, a collective): of the sampled rows for a step, of every row for a score."""

    def follow(self, ops, chunks, every_row: bool) -> None:
        for kind, value in ops:
            if kind == "apply":
                self.apply(value)
            else:
                self._forget(value)
        if every_row:
            self.score_rows_of(chunks)
        else:
            self.execute(chunks)

    def score_rows_of(self, chunks) -> None:
        hidden, _, _, _ = self._forward(chunks)
        self.model.logits(hidden)


def _build(
    conn: Connection, config, shard: TensorShard, platform, groups: tuple, shm_names, parent: int
) -> tuple[FollowerRunner, RankPages]:
    """This rank's shard of the model, joined to the others, over its part of the page pool
    (or, staged, over its own pool with a mirror in that part)."""
    loaded = load_engine_model(config, load_weights, shard, platform)
    capacity = group.reduce_capacity(
        loaded.config, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs
    )
    shm = None
    if shm_names:  # its stage's shared-memory all-reduce
        shm = ShmAllReduce(
            shard.world,
            shard.rank,
            capacity,
            shm_names[shard.stage],
            alive=lambda: os.getppid() == parent,
        )
    join_shard(loaded.model, loaded.config, shard, *groups, shm, lambda: os.getppid() == parent)
    spec = loaded.model.kv_spec(config.cache.page_size, config.resolved_kv_dtype)
    _, num_pages, nbytes, offset, staged = conn.recv()
    part = pool_of(receive_region(conn, nbytes), offset, spec, num_pages)
    pages = RankPages(platform.new_pool(spec, num_pages, False) if staged else part, part)
    kv = PagedKVCache(spec, num_pages, TORCH_DTYPES[config.compute_dtype], pool=pages.pool)
    runner = FollowerRunner(
        loaded.model,
        kv,
        get_backend(config.device.attention_backend, spec.layers[0].kind, platform),
        RunnerOptions(micro_batches=config.parallel.micro_batches),  # split as rank 0 splits
    )
    return runner, pages


@dataclass(frozen=True)
class RankPages:
    """This rank's pool, and its part of the shared block (the pool itself unless staged)."""

    pool: torch.Tensor
    part: torch.Tensor

    def stage(self, direction: str, pages: list[int]) -> None:
        if self.pool is not self.part:
            copy_runs(direction, self.pool, self.part, pages)


def main(fd: int) -> int:
    conn = Connection(fd)
    parent = os.getppid()  # before anything slow: rank 0 may die meanwhile
    _, config, rank, port, shm_names = conn.recv()
    torch.set_num_threads(env.serve_threads())
    shard, store = TensorShard.of(config, rank), client_store(port)
    platform = resolve(config.device.device).for_rank(rank)  # (rank 0 checked the config)
    world = platform.join_group(rank, config.parallel.world_size, store)  # rank 0's order
    tp = world
    if shard.stages > 1 and shard.world > 1:
        tp = platform.join_group(shard.rank, shard.world, store, f"stage{shard.stage}")
    try:
        runner, pages = _build(conn, config, shard, platform, (world, tp), shm_names, parent)
    except Exception as exc:  # rank 0 raises it as its own (a bad checkpoint, a split refused)
        exc.add_note(f"(on tensor-parallel rank {rank})")
        conn.send(("failed", exc))
        return 1
    conn.send(("ready",))
    try:
        while True:
            message = conn.recv()
            if message[0] == "stage":  # after the passes sent before it, as rank 0 needs
                pages.stage(*message[1:])
                conn.send(("staged",))
                continue
            _, ops, chunks, every_row = message
            runner.follow(ops, chunks, every_row)
    except EOFError:  # rank 0 closed the socket (or died): this rank's work is over
        return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
