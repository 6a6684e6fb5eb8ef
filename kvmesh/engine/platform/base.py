"""What a platform is: the device-specific part of the engine and nothing else.

Model code, the scheduler, the block manager, the page format and the mesh do not know which
platform runs them. A platform owns where the KV pool lives and how it is made, the FP8 page
codec, which attention backend `auto` means, which decode-step strategies can run, and the
kernel ops for tensors on its device (`kernels`: an op table with the CPU kernels' names, or
None where layers use their torch path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvmesh.engine.kv.layout import KVCacheSpec


class Platform(Protocol):
    name: str  # "cpu" | "cuda": what `--device` names
    device: torch.device  # where weights, activations and the KV pool live
    sums_in_shared_memory: bool  # a parallel engine's small all-reduces (parallel/shm_reduce.py)

    def check(self, config: Any) -> None:
        """InvalidRequestError naming the flag where the EngineConfig cannot run here."""
        ...

    def kernels(self) -> Any | None:
        """The op table for tensors on this device (kernels/__init__.py's names), or None."""
        ...

    def attention_backend(self, name: str) -> str:
        """The backend `--attention-backend NAME` means here (`auto` resolved)."""
        ...

    def moe_backend(self, name: str) -> str:
        """The routed-experts kernel `--moe-backend NAME` means here (`auto` resolved)."""
        ...

    def kv_transfer(self, name: str) -> str:
        """How transfers reach the pool here: "direct" or "staged" (pool/kv_pages.py)."""
        ...

    def decode_step(self, name: str) -> str:
        """The decode-step strategy `--decode-step NAME` runs as here."""
        ...

    def graph_recorder(self) -> Any:
        """How `--decode-step graphs` records a step (runner/graphs.py)."""
        ...

    def kv_budget(self, budget: int, warm_up: Callable[[], None] | None = None) -> int:
        """Bytes the KV pool may take of `--kv-cache-memory` here, now (after the weights);
        `warm_up`: a pass of the largest step, whose activations a GPU must leave room for
        (runner/warm_up.py)."""
        ...

    def new_pool(self, spec: KVCacheSpec, num_pages: int, hugepages: bool) -> torch.Tensor:
        """A zeroed pool of `num_pages` pages plus the null and scratch pages, [rows, bytes]."""
        ...

    def kv_codec(self) -> tuple[Callable, Callable]:
        """(quantize, dequantize) of FP8 pages on this device (pool/kv_fp8.py's format)."""
        ...

    def place(self, model: Any) -> Any:
        """A model built on the host, on this device (placement.py)."""
        ...

    def for_rank(self, rank: int) -> Platform:
        """The platform of a parallel engine's rank `rank` (its own GPU on CUDA)."""
        ...

    def join_group(self, rank: int, world: int, store: Any, prefix: str = "") -> Any:
        """The ranks' process group over rank 0's store (parallel/group.py): gloo on loopback
        for host tensors, NCCL for GPU ones; `prefix`: a subgroup's own names."""
        ...

    def int4_linear(self, weight: Any, dtype: torch.dtype) -> Any:
        """A linear over group-wise INT4 `weight` (quant/int4.py's Int4Weight), `dtype`
        activations, with this device's kernel."""
        ...
