"""The optional FlashInfer backend (`--attention-backend flashinfer`, CUDA with flashinfer-python
installed): FA2/FA3 paged attention reading kvmesh's bf16 pages in place, GQA layers.

A layer's pages are already FlashInfer's HND layout with a large page stride: K = data[..., 0, :]
and V = data[..., 1, :] of [pages, heads, slots, parts, dim] are [pages, heads, page_size, dim]
views (strides page, head, 2 * dim, 1), which FA2/FA3 accept (backend pinned: other FlashInfer
backends copy a strided cache). FP8 pages hold kvmesh's per-token exponents, which FlashInfer
cannot read: they go to the Triton backend.

kvmesh builds FlashInfer's CSR metadata per step (`FlashInferPlan`): each chunk's query rows
(qo_indptr), its pages (kv_indptr into kv_indices), the last page's tokens (last_page_len); the
queries of a chunk are the last of its KV (causal from the end). The kernel cannot run without a
GPU; tests/unit/test_flashinfer_plan.py checks these arrays with a pure-Python reader of the
same semantics against the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.engine.attention.base import BatchLayout, Slots
from kvmesh.engine.attention.triton_paged import build_triton_metadata
from kvmesh.engine.kernels.gpu.kv_write import write_kv
from kvmesh.engine.pool.kv_cache import GqaLayerKV
from kvmesh.errors import InvalidRequestError

WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class FlashInferPlan:
    """One step's FlashInfer metadata (int32, host): chunks in row order, decode rows first."""

    slot_mapping: Slots  # [T]: where each new token's KV is written
    qo_indptr: np.ndarray  # [chunks + 1]: the step's query rows of each chunk
    kv_indptr: np.ndarray  # [chunks + 1]: each chunk's pages in kv_indices
    kv_indices: np.ndarray  # [pages]: page ids, chunk after chunk
    last_page_len: np.ndarray  # [chunks]: tokens in each chunk's last page (1..page_size)
    page_size: int


def build_flashinfer_plan(layout: BatchLayout) -> FlashInferPlan:
    lengths = np.asarray(layout.starts, dtype=np.int64) + np.asarray(layout.widths, np.int64)
    counts = -(-lengths // layout.page_size)
    tables = layout.block_tables
    indices = np.concatenate(
        [np.asarray(t[:n], dtype=np.int32) for t, n in zip(tables, counts, strict=True)]
    )
    slots = build_triton_metadata(layout).slot_mapping  # (the same slots)
    return FlashInferPlan(
        slots,
        np.concatenate([[0], np.cumsum(layout.widths)]).astype(np.int32),
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
        indices,
        (lengths - (counts - 1) * layout.page_size).astype(np.int32),
        layout.page_size,
    )


def paged_views(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a GQA layer's pages as FlashInfer's HND [pages, heads, page_size, dim]."""
    return data[..., 0, :], data[..., 1, :]


class FlashInferAttention:
    kind = "gqa"
    compilable = False
    graphable = False  # (FlashInfer's CUDA-graph wrappers: not wired yet)

    def __init__(self) -> None:
        try:
            import flashinfer
        except ImportError as exc:
            raise InvalidRequestError(
                "--attention-backend flashinfer needs flashinfer-python (and CUDA)"
            ) from exc
        self._flashinfer: Any = flashinfer
        self._wrapper: Any = None

    def build_metadata(self, layout: BatchLayout) -> FlashInferPlan:
        return build_flashinfer_plan(layout)

    def forward(self, q, k, v, cache: GqaLayerKV, plan: FlashInferPlan, scale: float):
        layer = cache.layer
        if layer.exps is not None:
            raise InvalidRequestError("flashinfer reads bf16/fp32 pages; FP8 pages: triton")
        device = layer.data.device
        slots = Slots(plan.slot_mapping.page.to(device), plan.slot_mapping.offset.to(device))
        write_kv(torch.stack((k, v), dim=-2), slots.page, slots.offset, layer.data, None)
        wrapper = self._planned(plan, q, layer.data, scale)
        return wrapper.run(q, paged_views(layer.data))

    def _planned(self, plan: FlashInferPlan, q, data, scale: float) -> Any:
        """The prefill wrapper planned for this step (once per step: every layer reuses it)."""
        if self._wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self._wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, kv_layout="HND", backend="fa2"
            )
            self._planned_for = None
        if self._planned_for is not plan:
            as_tensor = lambda a: torch.from_numpy(a).to(q.device)  # noqa: E731
            self._wrapper.plan(
                as_tensor(plan.qo_indptr),
                as_tensor(plan.kv_indptr),
                as_tensor(plan.kv_indices),
                as_tensor(plan.last_page_len),
                q.shape[1],
                data.shape[1],
                q.shape[2],
                plan.page_size,
                causal=True,
                sm_scale=scale,
                q_data_type=q.dtype,
                kv_data_type=data.dtype,
            )
            self._planned_for = plan
        return self._wrapper
