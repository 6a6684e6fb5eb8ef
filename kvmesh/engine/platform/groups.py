"""The process groups of a parallel engine's ranks, over rank 0's store: gloo on loopback for
host tensors, NCCL for GPU ones (the platforms' `join_group`)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

# gloo would pick the interface of the host name's address: every rank's device on loopback
HOST = "127.0.0.1"
# a collective runs only inside a step; a rank that died closes its sockets, which ends it
TIMEOUT = datetime.timedelta(minutes=10)


def master_store(world: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`.port` tells the others)."""
    return dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def client_store(port: int) -> dist.TCPStore:
    """A rank's connection to rank 0's store."""
    return dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)


def join(rank: int, world: int, store: dist.Store, prefix: str = "") -> dist.ProcessGroupGloo:
    """A group of `world` ranks over `store` (rank 0's master store, or a client of it); with
    `prefix`, a subgroup of its own names (a pipeline stage's tensor-parallel ranks). A group of
    its own, not torch's default one, so one process may hold several engines' groups; its
    device is bound to loopback."""
    if prefix:
        store = dist.PrefixStore(prefix, store)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    options._timeout = TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, options)


def nccl_group(rank: int, world: int, store: dist.Store, prefix: str = "") -> dist.ProcessGroup:
    """A group of `world` ranks on the current GPU each (NCCL; see `join` for `prefix`)."""
    if prefix:
        store = dist.PrefixStore(prefix, store)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = TIMEOUT
    options.group_name = f"kvmesh-{prefix or 'world'}"  # one process may hold two groups
    return dist.ProcessGroupNCCL(store, rank, world, options)
