"""FlashInfer's MLA wrapper over kvmesh's MLA pages (`--attention-backend flashinfer`, MLA
layers; CUDA with flashinfer-python): absorbed attention, one latent head, as the Triton
backend runs it (W_UK into the query, W_UV onto the output: MlaWeights).

A layer's pages are [pages, 1, page_size, 1, latent + rope]; FlashInfer's MLA kernels take the
latent and rope parts as two [pages, page_size, dim] tensors, which are strided views of the
same bytes here (`mla_views`, SGLang passes such views of its own buffer). The step's plan is
the GQA backend's (FlashInferPlan) with each chunk's KV length (`kv_lens`) in place of its last
page's. tests/unit/test_flashinfer_plan.py reads these arrays with a pure-Python consumer of the
wrapper's semantics against the torch MLA backend; the kernel itself needs a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmesh.engine.attention.base import BatchLayout
from kvmesh.engine.attention.flashinfer_backend import (
    FlashInferPlan,
    StepWrapper,
    build_flashinfer_plan,
    write_new_kv,
)
from kvmesh.engine.layers.mla import MlaWeights
from kvmesh.engine.pool.kv_cache import MlaLayerKV


def mla_views(data: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent and rope parts of an MLA layer's pages, each [pages, page_size, dim]."""
    entries = data[:, 0, :, 0, :]
    return entries[..., :rank], entries[..., rank:]


class FlashInferMlaAttention:
    kind = "mla"
    compilable = False
    graphable = False

    def __init__(self) -> None:
        self._step = StepWrapper(
            lambda fi, workspace: fi.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa2")
        )

    def build_metadata(self, layout: BatchLayout) -> FlashInferPlan:
        return build_flashinfer_plan(layout)

    def forward(
        self, q_nope, q_pe, entry, cache: MlaLayerKV, plan: FlashInferPlan, w: MlaWeights
    ) -> torch.Tensor:
        data = cache.layer.data
        write_new_kv(entry[:, None, None, :], plan, cache.layer)
        rank = w.kv_b.shape[1]
        q_latent = w.absorb(q_nope)

        def do_plan(wrapper: Any) -> None:
            wrapper.plan(
                *plan.on(q_pe.device),
                torch.from_numpy(plan.kv_lens).to(q_pe.device),
                w.num_heads,
                rank,
                q_pe.shape[-1],
                plan.page_size,
                True,  # causal: a chunk's queries are the last of its KV
                w.scale,
                q_latent.dtype,
                data.dtype,
            )

        wrapper = self._step.get(plan, q_pe.device, do_plan)
        latent = wrapper.run(q_latent.contiguous(), q_pe.contiguous(), *mla_views(data, rank))
        return w.expand(latent)
