"""The ranks of one tensor-parallel worker as a torch.distributed group (gloo on CPU, on
loopback), and the all-reduce that joins a split layer's partial outputs."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from kvmesh.engine.parallel.shm_reduce import ShmAllReduce
from kvmesh.errors import EngineFailure

# gloo would pick the interface of the host name's address: keep every rank on loopback
HOST = "127.0.0.1"
# a collective runs only inside a step; a rank that died closes its sockets, which ends it
TIMEOUT = datetime.timedelta(minutes=10)


def master_store(world: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`.port` tells the others)."""
    return dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False,
                         timeout=TIMEOUT)  # fmt: skip


def join(rank: int, world: int, store: dist.Store | None = None,
         port: int = 0) -> dist.ProcessGroupGloo:  # fmt: skip
    """This rank's group: rank 0 with its master store, the others by its port. A group of its
    own, not torch's default one, so one process may hold several engines' groups."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if store is None:
        store = dist.TCPStore(HOST, port, world, is_master=False, timeout=TIMEOUT)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    options._timeout = TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, options)


class AllReduced:
    """A split layer (attention or MLP) whose partial outputs the ranks sum: in fp32, so a bf16
    model rounds the whole sum once, as one rank would round its own."""

    def __init__(self, inner: Any, group: dist.ProcessGroupGloo, shm: ShmAllReduce | None) -> None:
        self.inner, self.group, self.shm = inner, group, shm

    def __call__(self, *args: Any) -> torch.Tensor:
        out = self.inner(*args)
        total = out if out.dtype == torch.float32 else out.float()
        if self.shm is not None and self.shm.fits(total) and total.is_contiguous():
            self.shm(total)  # every rank decides by the size alone: the same path everywhere
            return total if total is out else total.to(out.dtype)
        try:
            self.group.allreduce([total]).wait()
        except RuntimeError as exc:  # gloo: a peer closed its sockets (it died) or timed out
            raise EngineFailure(f"a tensor-parallel rank of this engine is gone: {exc}") from exc
        return total if total is out else total.to(out.dtype)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def all_reduced_layers(model: Any, group: dist.ProcessGroupGloo,
                       shm: ShmAllReduce | None = None) -> None:  # fmt: skip
    """Each decoder layer's attention and MLP of a sharded model, summed over the ranks
    (through shared memory where the tensor fits, else gloo)."""
    for layer in model.layers:
        layer.attention = AllReduced(layer.attention, group, shm)
        layer.mlp = AllReduced(layer.mlp, group, shm)


def reduce_capacity(hidden_size: int, max_rows: int) -> int:
    """Floats a shared-memory slot holds: a step's rows of hidden states."""
    return hidden_size * max_rows
