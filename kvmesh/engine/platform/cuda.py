"""The CUDA platform: the KV pool one allocation on the GPU (a transfer engine's registration
spans a whole cudaMalloc block), the Triton paged attention that reads kvmesh's pages in place,
the Triton FP8 codec, and torch's CUDA ops under the layers' torch paths (no C++ CPU kernels).
Decode steps run eager. Checked on a GPU only by scripts/device_check.py; its Triton kernels
run on CPU tensors under TRITON_INTERPRET=1 in the test suite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.errors import InvalidRequestError

MIN_PAGE_SIZE = 16


def unavailable_reason() -> str | None:
    """Why `--device cuda` cannot run in this process; None when it can."""
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU build")
        return f"torch sees no CUDA device here ({build})"
    try:
        import triton  # noqa: F401  (the attention and codec kernels)
    except ImportError:
        return "the CUDA path needs triton (pip install 'kvmesh[cuda]')"
    return None


class CudaPlatform:
    name = "cuda"
    sums_in_shared_memory = False  # NCCL sums the GPU tensors

    def __init__(self, index: int = 0) -> None:
        self.device = torch.device("cuda", index)

    def check(self, config: Any) -> None:
        if config.cache.page_size < MIN_PAGE_SIZE:  # tl.dot's K of the P.V product
            raise InvalidRequestError(
                f"--page-size {config.cache.page_size}: --device cuda needs at least "
                f"{MIN_PAGE_SIZE} tokens a page (the Triton kernels' tiles)"
            )
        backend = self.attention_backend(config.device.attention_backend)
        if backend == "flashinfer" and config.resolved_kv_dtype.startswith("fp8"):
            raise InvalidRequestError(
                "--attention-backend flashinfer reads bf16/fp32 pages; FP8 pages (their "
                "per-token exponents): --attention-backend triton"
            )
        self.moe_backend(config.device.moe_backend)
        self.decode_step(config.device.decode_step)
        if self.kv_transfer(config.device.kv_transfer) == "direct":
            _check_direct(config.parallel.world_size)

    def kernels(self) -> Any | None:
        return None

    def attention_backend(self, name: str) -> str:
        if name == "cpu":
            raise InvalidRequestError("--attention-backend cpu runs on --device cpu only")
        return "triton" if name == "auto" else name

    def moe_backend(self, name: str) -> str:
        return "triton" if name == "auto" else name

    def kv_transfer(self, name: str) -> str:
        return "staged" if name == "auto" else name

    def decode_step(self, name: str) -> str:
        if name == "compiled":
            raise InvalidRequestError("--decode-step compiled runs on --device cpu only")
        return "eager" if name == "eager" else "graphs"  # fused: the CPU kernels' step

    def graph_recorder(self) -> Any:
        from kvmesh.engine.runner.graphs import cuda_record

        return cuda_record(torch.cuda.graph_pool_handle())

    def kv_budget(self, budget: int, warm_up: Callable[[], None] | None = None) -> int:
        """The flag's budget, within what the GPU has free after the weights, less the largest
        step's activations (`warm_up`'s peak, measured; where none can run alone, parallel
        ranks, 1 GiB) and a tenth of the card (graphs, the allocator's slack, NCCL)."""
        peak = 1 << 30
        if warm_up is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            warm_up()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, min(budget, free - peak - total // 10))

    def new_pool(self, spec: KVCacheSpec, num_pages: int, hugepages: bool) -> torch.Tensor:
        if hugepages:
            raise InvalidRequestError("--kv-hugepages is for host memory (--device cpu)")
        return torch.zeros(num_pages + 2, spec.page_bytes, dtype=torch.uint8, device=self.device)

    def kv_codec(self) -> tuple[Callable, Callable]:
        from kvmesh.engine.kernels.gpu import kv_fp8

        return kv_fp8.quantize, kv_fp8.dequantize

    def place(self, model: Any) -> Any:
        from kvmesh.engine.platform.placement import place
        from kvmesh.engine.quant.int4_cuda import CudaInt4Linear

        return place(model, self.device, lambda layer: CudaInt4Linear.from_cpu(layer, self.device))

    def for_rank(self, rank: int) -> CudaPlatform:
        """Rank r on GPU r (of the GPUs this process sees, CUDA_VISIBLE_DEVICES)."""
        return CudaPlatform(rank % torch.cuda.device_count())

    def join_group(self, rank: int, world: int, store: Any, prefix: str = "") -> Any:
        """NCCL; gloo (its sums copy through the host) where ranks share a GPU, which NCCL
        refuses: more ranks than GPUs, as on a one-GPU check (scripts/device_check.py)."""
        from kvmesh.engine.platform.groups import join, nccl_group

        torch.cuda.set_device(self.device)  # NCCL's communicator binds the current GPU
        if world > torch.cuda.device_count():
            return join(rank, world, store, prefix)
        return nccl_group(rank, world, store, prefix)

    def int4_linear(self, weight: Any, dtype: torch.dtype) -> Any:
        from kvmesh.engine.quant.int4_cuda import CudaInt4Linear

        return CudaInt4Linear(weight, dtype, self.device)


def check() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise InvalidRequestError(f"--device cuda: {reason}; use --device cpu or auto")


def _check_direct(world: int) -> None:
    """`--kv-transfer direct` registers the GPU pool with the transfer engine: only Mooncake's
    CUDA build can, and only one rank's pool (each rank's GPU pool would need its own engine)."""
    from importlib import metadata

    if world > 1:
        raise InvalidRequestError(
            "--kv-transfer direct with parallel ranks on GPUs: not yet (their pools are staged "
            "through the ranks' shared host block); use --kv-transfer staged"
        )
    try:
        metadata.version("mooncake-transfer-engine")  # the CUDA build's distribution
    except metadata.PackageNotFoundError:
        raise InvalidRequestError(
            "--kv-transfer direct on --device cuda needs Mooncake's CUDA build "
            "(pip install mooncake-transfer-engine, in place of the -non-cuda one) to register "
            "GPU memory; use --kv-transfer staged (the default)"
        ) from None
