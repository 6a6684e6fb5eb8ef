"""The FlashInfer backend's step metadata (CSR arrays over kvmesh's pages) and its strided HND
views of a layer's pages, read by a pure-Python consumer of FlashInfer's paged-KV semantics
(each chunk's pages in kv_indices, its last page's tokens, its queries the last of its KV),
give the torch backend's attention: the FlashInfer kernel itself needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.engine.attention import BatchLayout, get_backend
from kvmesh.engine.attention.base import Slots
from kvmesh.engine.attention.flashinfer_backend import build_flashinfer_plan, paged_views
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.pool.kv_cache import PagedKVCache

PAGE = 16
ROWS = [(40, 1), (17, 1), (0, 1), (0, 20), (33, 9)]  # (cached, new) per chunk, decode first


def _consume(q, keys, values, plan, scale: float) -> torch.Tensor:
    """FlashInfer's paged prefill semantics, in fp32: chunk i attends its pages
    kv_indices[kv_indptr[i]:kv_indptr[i + 1]], the last holding last_page_len[i] tokens, its
    query j seeing KV [0, kv_len - q_len + j]."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // keys.shape[1]
    for i in range(len(plan.qo_indptr) - 1):
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]]
        kv_len = (len(pages) - 1) * plan.page_size + int(plan.last_page_len[i])
        k = keys[pages].permute(0, 2, 1, 3).reshape(-1, keys.shape[1], keys.shape[3])[:kv_len]
        v = values[pages].permute(0, 2, 1, 3).reshape(-1, keys.shape[1], keys.shape[3])[:kv_len]
        rows = slice(int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1]))
        query = q[rows].float()
        q_len = query.shape[0]
        k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", query, k) * scale
        seen = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def _tables() -> tuple[list[tuple[int, ...]], int]:
    """Each chunk's pages, in order from page 0; the pages used."""
    tables, used = [], 0
    for start, width in ROWS:
        count = -(-(start + width) // PAGE)
        tables.append(tuple(range(used, used + count)))
        used += count
    return tables, used


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_the_plan_and_page_views_give_the_torch_backends_attention(kv_dtype):
    dtype = torch.float32 if kv_dtype == "fp32" else torch.bfloat16
    cache = PagedKVCache(KVCacheSpec.gqa(2, 2, 32, PAGE, kv_dtype), 14, dtype)
    tables, used = _tables()
    layer = cache.layers[1]  # the second layer: its views start inside each page
    gen = torch.Generator().manual_seed(0)
    every = Slots.of(torch.arange(used * PAGE), PAGE)
    layer.layer.write(every, torch.randn(used * PAGE, 2, 2, 32, generator=gen).to(dtype))
    layout = BatchLayout(3, tuple(tables), *zip(*ROWS, strict=True), PAGE, cache.null_page)
    tokens = sum(w for _, w in ROWS)
    q, k, v = (torch.randn(tokens, h, 32, generator=gen).to(dtype) for h in (8, 2, 2))
    torch_backend = get_backend("torch", "gqa")
    want = torch_backend.forward(q, k, v, layer, torch_backend.build_metadata(layout), 0.2)

    plan = build_flashinfer_plan(layout)
    assert plan.qo_indptr.tolist() == [0, 1, 2, 3, 23, 32]
    assert plan.last_page_len.tolist() == [9, 2, 1, 4, 10]
    assert np.array_equal(plan.kv_indices, np.arange(used))
    keys, values = paged_views(layer.layer.data)
    element = cache.pool.element_size() * (4 if kv_dtype == "fp32" else 2)
    assert keys.shape == (16, 2, PAGE, 32) and keys.stride()[2:] == (64, 1)
    assert keys.stride(0) * element == cache.spec.page_bytes  # in place: the pool's pages
    assert values.data_ptr() - keys.data_ptr() == 32 * element
    got = _consume(q, keys, values, plan, 0.2)
    torch.testing.assert_close(
        got, want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2
    )


def _consume_mla(q_latent, q_pe, ckv, kpe, plan, scale: float) -> torch.Tensor:
    """FlashInfer's MLA paged semantics, in fp32: chunk i attends the first kv_lens[i] entries
    of its pages kv_indices[kv_indptr[i]:kv_indptr[i + 1]], causally from the end; scores over
    latent|rope, values the latents."""
    out = torch.empty(q_latent.shape, dtype=torch.float32)
    for i in range(len(plan.qo_indptr) - 1):
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]]
        kv_len = int(plan.kv_lens[i])
        latents = ckv[pages].reshape(-1, ckv.shape[-1])[:kv_len].float()
        keys = torch.cat([latents, kpe[pages].reshape(-1, kpe.shape[-1])[:kv_len].float()], -1)
        rows = slice(int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1]))
        query = torch.cat([q_latent[rows], q_pe[rows]], -1).float()
        q_len = query.shape[0]
        scores = torch.einsum("qhd,kd->hqk", query, keys) * scale
        seen = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,kd->qhd", probs, latents)
    return out


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_the_plan_and_mla_views_give_the_torch_mla_backends_attention(kv_dtype):
    """The MLA wrapper's inputs (the plan with kv_lens, latent and rope views of the pages,
    the query through W_UK) read as FlashInfer reads them, then W_UV: the torch MLA backend."""
    from kvmesh.engine.attention.flashinfer_mla import mla_views
    from kvmesh.engine.kv.layout import LayerKVSpec
    from kvmesh.engine.layers.mla import MlaWeights

    dtype = torch.float32 if kv_dtype == "fp32" else torch.bfloat16
    rank, rope, heads, nope, vdim = 32, 16, 4, 8, 8
    spec = KVCacheSpec((LayerKVSpec("mla", 1, rank + rope),) * 2, PAGE, kv_dtype)
    cache = PagedKVCache(spec, 14, dtype)
    tables, used = _tables()
    layer = cache.layers[1]
    gen = torch.Generator().manual_seed(0)
    every = Slots.of(torch.arange(used * PAGE), PAGE)
    layer.layer.write(every, torch.randn(used * PAGE, 1, 1, rank + rope, generator=gen).to(dtype))
    layout = BatchLayout(3, tuple(tables), *zip(*ROWS, strict=True), PAGE, cache.null_page)
    tokens = sum(w for _, w in ROWS)
    kv_b = torch.randn(heads * (nope + vdim), rank, generator=gen).to(dtype) / 4
    w = MlaWeights(kv_b, heads, nope, vdim, 0.15)
    q_nope = torch.randn(tokens, heads, nope, generator=gen).to(dtype)
    q_pe = torch.randn(tokens, heads, rope, generator=gen).to(dtype)
    entry = torch.randn(tokens, rank + rope, generator=gen).to(dtype)
    torch_mla = get_backend("torch", "mla")
    want = torch_mla.forward(q_nope, q_pe, entry, layer, torch_mla.build_metadata(layout), w)

    plan = build_flashinfer_plan(layout)
    assert plan.kv_lens.tolist() == [41, 18, 1, 20, 42]
    ckv, kpe = mla_views(layer.layer.data, rank)
    assert ckv.shape == (16, PAGE, rank) and kpe.shape == (16, PAGE, rope)
    assert ckv.stride()[1:] == (rank + rope, 1) and kpe.data_ptr() > ckv.data_ptr()
    got = w.expand(_consume_mla(w.absorb(q_nope), q_pe, ckv, kpe, plan, w.scale).to(dtype))
    torch.testing.assert_close(
        got.float(), want.float(), atol=3e-2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2
    )
