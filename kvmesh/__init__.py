"""kvmesh: serve large language models as a mesh of gRPC services."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# torch allocates tensors of 2 MB and more on transparent huge pages where the kernel allows it
# (madvise mode): decode attention walks KV pages scattered over hundreds of MB, where 4 KB pages
# miss the TLB on nearly every page (measured: docs/benchmarks-history.md, "bf16 linears on AMX
# tiles, huge pages, and a bench-step correction"). Set before torch's first allocation, which
# reads it once; THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from kvmesh.engine.core.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from kvmesh.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":  # lazy: importing kvmesh must not pull in torch
        from kvmesh.engine.llm import LLM

        return LLM
    raise AttributeError(name)
