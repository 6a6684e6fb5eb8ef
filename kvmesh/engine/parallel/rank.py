"""A tensor-parallel rank other than 0 (`python -m kvmesh.engine.parallel.rank FD`): joins the
worker's group, builds its shard of the model and KV pages, then runs every forward pass rank 0
sends over the socket FD, until the socket closes."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

import torch

from kvmesh import env
from kvmesh.engine.attention import get_backend
from kvmesh.engine.engine_setup import TORCH_DTYPES, load_engine_model
from kvmesh.engine.kv_cache import PagedKVCache
from kvmesh.engine.loader import load_weights
from kvmesh.engine.parallel import group
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.parallel.shm_reduce import ShmAllReduce
from kvmesh.engine.runner import ModelRunner


class FollowerRunner(ModelRunner):
    """Applies what rank 0 applied and runs its passes; the logits are rank 0's to compute."""

    def follow(self, ops, chunks) -> None:
        for kind, value in ops:
            if kind == "apply":
                self.apply(value)
            else:
                self._forget(value)
        self._forward(chunks)


def main(fd: int) -> int:
    conn = Connection(fd)
    _, config, rank, world, port, shm_name = conn.recv()
    torch.set_num_threads(env.serve_threads())
    ranks = group.join(rank, world, port=port)
    loaded = load_engine_model(config, load_weights, TensorShard(rank, world))
    parent = os.getppid()
    capacity = group.reduce_capacity(loaded.config.hidden_size, config.max_num_batched_tokens)
    shm = ShmAllReduce(world, rank, capacity, shm_name, alive=lambda: os.getppid() == parent)
    group.all_reduced_layers(loaded.model, ranks, shm)
    spec = loaded.model.kv_spec(config.page_size, config.resolved_kv_dtype)
    try:
        _, num_pages = conn.recv()
        kv = PagedKVCache(spec, num_pages, TORCH_DTYPES[config.compute_dtype])
        runner = FollowerRunner(loaded.model, kv, get_backend(config.attention_backend,
                                                              spec.layers[0].kind))  # fmt: skip
        while True:
            _, ops, chunks = conn.recv()
            runner.follow(ops, chunks)
    except EOFError:  # rank 0 closed the socket (or died): this rank's work is over
        return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
