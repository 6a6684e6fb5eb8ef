"""The all-reduce of ranks on one host through shared memory: gloo's over loopback TCP took
most of a token's time (SmolLM2 makes 60 all-reduces of 576 floats per token), this little
more than the wait for the slowest rank (docs/benchmarks-history.md, "Tensor parallelism on 2
cores").

Layout: one counter per rank (a cache line each), then two sets (by the call's parity) of one
fp32 slot per rank. A call writes the rank's tensor into its slot of this parity, then its
counter; waits until every counter has reached the call; sums the slots in rank order (so every
rank gets the same bits). A rank can be at most one call ahead of the slowest (it waits for
all at each), so the other parity's slots are never read while written.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

from kvmesh.errors import EngineFailure

_LINE = 64  # bytes per counter
CHECK_EVERY_S = 0.5  # how often a waiting rank asks whether its peers are alive


class ShmAllReduce:
    def __init__(
        self,
        world: int,
        rank: int,
        capacity: int,
        name: str | None = None,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """capacity: floats per slot (larger tensors are the caller's to reduce otherwise);
        name: the block rank 0 made (None: make it); alive: whether the peers still run."""
        self.world, self.rank, self.capacity, self.alive = world, rank, capacity, alive
        size = world * _LINE + 2 * world * capacity * 4
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        if name is not None:  # the creator owns (and unlinks) it
            _untrack(self.shm)
        buf = self.shm.buf
        self._counters = np.ndarray((world, _LINE // 8), np.int64, buf)[:, 0]
        slots = np.ndarray((2, world, capacity), np.float32, buf, offset=world * _LINE)
        self._slots = torch.from_numpy(slots)
        self._calls = 0

    @property
    def name(self) -> str:
        return self.shm.name

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() <= self.capacity

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (fp32, contiguous) over the ranks, in place."""
        self._calls += 1
        call, n = self._calls, tensor.numel()
        slots = self._slots[call & 1, :, :n]
        slots[self.rank].copy_(tensor.view(-1))
        self._counters[self.rank] = call  # after the data: x86 keeps stores in order
        self._wait(call)
        total = tensor.view(-1)
        total.copy_(slots[0])
        for r in range(1, self.world):
            total.add_(slots[r])

    def _wait(self, call: int) -> None:
        checked = time.monotonic()
        while self._counters.min() < call:
            os.sched_yield()  # the rank we wait for may need this core
            if time.monotonic() - checked > CHECK_EVERY_S:
                if not self.alive():
                    raise EngineFailure("a tensor-parallel rank of this engine is gone")
                checked = time.monotonic()

    def close(self) -> None:
        self._slots = self._counters = None  # views into the block go before it does
        # a sum still running on another thread holds a view: then unmapped at exit (the block
        # is unlinked below all the same)
        with contextlib.suppress(BufferError):
            self.shm.close()
        if self.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """A block this process only attached to: Python's resource tracker must not unlink it."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except (ImportError, AttributeError, KeyError):
        pass
