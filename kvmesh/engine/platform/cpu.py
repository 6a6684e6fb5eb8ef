"""The CPU platform: what the engine has always run on. Pools in host memory (a memfd block on
2 MiB hugepages when asked; parallel/shared_pages.py), kvmesh's C++ kernels where they build
(kernels/), the paged CPU attention, the fused and inductor-compiled decode steps."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.errors import InvalidRequestError


class CpuPlatform:
    name = "cpu"
    device = torch.device("cpu")
    sums_in_shared_memory = True

    def check(self, config: Any) -> None:
        self.attention_backend(config.device.attention_backend)
        self.moe_backend(config.device.moe_backend)
        self.decode_step(config.device.decode_step)

    def kernels(self) -> Any | None:
        return cpu_ops()

    def attention_backend(self, name: str) -> str:
        if name == "flashinfer":
            raise InvalidRequestError("--attention-backend flashinfer runs on --device cuda only")
        _triton_interpreted("--attention-backend", name)
        if name != "auto":
            return name
        return "cpu" if cpu_ops() is not None else "torch"

    def moe_backend(self, name: str) -> str:
        _triton_interpreted("--moe-backend", name)
        return "torch" if name == "auto" else name

    def kv_transfer(self, name: str) -> str:
        return "direct" if name == "auto" else name

    def decode_step(self, name: str) -> str:
        _triton_interpreted("--decode-step", name, "graphs")
        return name

    def graph_recorder(self) -> Any:
        from kvmesh.engine.runner.graphs import eager_record

        return eager_record  # a graph's contract, re-run: checks of the graph step's buffers

    def kv_budget(self, budget: int, warm_up: Callable[[], None] | None = None) -> int:
        return budget  # host memory: the flag's word (no pass measured)

    def new_pool(self, spec: KVCacheSpec, num_pages: int, hugepages: bool) -> torch.Tensor:
        if hugepages:
            from kvmesh.engine.parallel.shared_pages import new_pool

            return new_pool(spec, num_pages, hugepages=True)
        return torch.zeros(num_pages + 2, spec.page_bytes, dtype=torch.uint8)

    def kv_codec(self) -> tuple[Callable, Callable]:
        from kvmesh.engine.pool import kv_fp8

        return kv_fp8.quantize, kv_fp8.dequantize

    def place(self, model: Any) -> Any:
        return model  # built where it runs

    def for_rank(self, rank: int) -> CpuPlatform:
        return self

    def join_group(self, rank: int, world: int, store: Any, prefix: str = "") -> Any:
        from kvmesh.engine.platform.groups import join

        return join(rank, world, store, prefix)

    def int4_linear(self, weight: Any, dtype: torch.dtype) -> Any:
        from kvmesh.engine.quant.int4 import Int4Linear

        return Int4Linear(weight, dtype)


def _triton_interpreted(flag: str, name: str, gpu_only: str = "triton") -> None:
    if name == gpu_only and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError(
            f"{flag} {name} runs on --device cuda, or on the CPU only under "
            "TRITON_INTERPRET=1 (slowly: for checks)"
        )
