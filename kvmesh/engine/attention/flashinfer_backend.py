"""The optional FlashInfer backend (`--attention-backend flashinfer`, CUDA with flashinfer-python
installed): FA2 paged attention reading kvmesh's bf16 pages in place, GQA layers (MLA layers:
flashinfer_mla.py, over the same plan).

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

from collections.abc import Callable
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
    kv_lens: np.ndarray  # [chunks]: each chunk's KV tokens (the MLA wrapper's kv_len_arr)
    page_size: int

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """qo_indptr, kv_indptr, kv_indices as int32 tensors on `device`."""
        return tuple(
            torch.from_numpy(a).to(device)
            for a in (self.qo_indptr, self.kv_indptr, self.kv_indices)
        )


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
        lengths.astype(np.int32),
        layout.page_size,
    )


def paged_views(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a GQA layer's pages as FlashInfer's HND [pages, heads, page_size, dim]."""
    return data[..., 0, :], data[..., 1, :]


class StepWrapper:
    """A FlashInfer wrapper (made on first use with its workspace) planned once per step:
    every layer of the step runs on the plan of its first."""

    def __init__(self, make: Callable[[Any, torch.Tensor], Any]) -> None:
        try:
            import flashinfer
        except ImportError as exc:
            raise InvalidRequestError(
                "--attention-backend flashinfer needs flashinfer-python (and CUDA)"
            ) from exc
        self._flashinfer, self._make = flashinfer, make
        self._wrapper: Any = None
        self._planned_for: FlashInferPlan | None = None

    def get(self, plan: FlashInferPlan, device: torch.device, do_plan: Callable[[Any], None]):
        if self._wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = self._make(self._flashinfer, workspace)
        if self._planned_for is not plan:
            do_plan(self._wrapper)
            self._planned_for = plan
        return self._wrapper


def write_new_kv(entries: torch.Tensor, plan: FlashInferPlan, layer: Any) -> None:
    """The step's new tokens' KV into their slots (Triton's fused write; bf16/fp32 pages)."""
    if layer.exps is not None:
        raise InvalidRequestError("flashinfer reads bf16/fp32 pages; FP8 pages: triton")
    device = layer.data.device
    slots = Slots(plan.slot_mapping.page.to(device), plan.slot_mapping.offset.to(device))
    write_kv(entries, slots.page, slots.offset, layer.data, None)


class FlashInferAttention:
    kind = "gqa"
    compilable = False
    graphable = False  # (FlashInfer's CUDA-graph wrappers: not wired yet)

    def __init__(self) -> None:
        self._step = StepWrapper(
            lambda fi, workspace: fi.BatchPrefillWithPagedKVCacheWrapper(
                workspace, kv_layout="HND", backend="fa2"
            )
        )

    def build_metadata(self, layout: BatchLayout) -> FlashInferPlan:
        return build_flashinfer_plan(layout)

    def forward(self, q, k, v, cache: GqaLayerKV, plan: FlashInferPlan, scale: float):
        data = cache.layer.data
        write_new_kv(torch.stack((k, v), dim=-2), plan, cache.layer)

        def do_plan(wrapper: Any) -> None:
            wrapper.plan(
                *plan.on(q.device),
                torch.from_numpy(plan.last_page_len).to(q.device),
                q.shape[1],
                data.shape[1],
                q.shape[2],
                plan.page_size,
                causal=True,
                sm_scale=scale,
                q_data_type=q.dtype,
                kv_data_type=data.dtype,
            )

        return self._step.get(plan, q.device, do_plan).run(q, paged_views(data))
