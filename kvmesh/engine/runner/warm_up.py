"""The activations of the largest step, measured before the KV pool is sized: the CUDA
platform's budget is the GPU's free memory after the weights, less this peak and a reserve (the
profiling pass of vLLM and nano-vllm). One forward of a step's most rows, each a padding row
whose KV goes to the scratch page of a pool of one page: the linears, the experts and the norms
see a full step's rows; the LM head runs on the sampled rows only, a few."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvmesh.engine.attention.base import BatchLayout
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.pool.kv_cache import PagedKVCache


def padding_layout(kv: PagedKVCache, rows: int, table_width: int = 0) -> BatchLayout:
    """`rows` decode rows of one new token each, every one in `kv`'s scratch page (nothing a
    request holds is touched): a warm-up or capture step of that many rows."""
    scratch = ((kv.scratch_page,),) * rows
    page_size = kv.spec.page_size
    return BatchLayout(
        rows, scratch, (0,) * rows, (1,) * rows, page_size, kv.null_page, table_width
    )


def padding_pass(
    model: Any, spec: KVCacheSpec, attention: Any, rows: int, dtype: torch.dtype, platform: Any
) -> Callable[[], None]:
    """A pass of `rows` padding rows through `model` on `platform` (for `kv_budget`)."""

    def run() -> None:
        kv = PagedKVCache(spec, 1, dtype, pool=platform.new_pool(spec, 1, False))
        ids = torch.zeros(rows, dtype=torch.long, device=platform.device)
        meta = attention.build_metadata(padding_layout(kv, rows))
        with torch.inference_mode():
            model.forward(ids, ids, meta, kv.layers, attention)

    return run
