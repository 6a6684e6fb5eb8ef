"""The page pool layout: one physical page is one contiguous byte range holding every layer."""

from __future__ import annotations

import torch

from kvmesh.engine.attention import AttentionMetadata, Slots
from kvmesh.engine.attention.torch_backend import TorchAttention
from kvmesh.engine.kv_cache import KVCacheSpec, PagedKVCache


def test_written_kv_lands_inside_its_page_bytes():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)
    cache = PagedKVCache(spec, num_pages=5)
    slots = torch.tensor([2 * 4 + 1, 4 * 4 + 3])  # page 2 offset 1, page 4 offset 3
    meta = AttentionMetadata(Slots.of(slots, 4), 0, None, None, ())
    for layer, (k_cache, v_cache) in enumerate(cache.layers):
        k = torch.full((2, 2, 4), float(layer + 1))
        TorchAttention().forward(k.repeat(1, 2, 1), k, -k, k_cache, v_cache, meta, 1.0)
    page_elems = spec.page_bytes // 4
    flat = cache.pool.view(-1)
    for page in range(5):
        chunk = flat[page * page_elems : (page + 1) * page_elems]
        if page in (2, 4):
            assert sorted(set(chunk.abs().tolist())) == [0.0, 1.0, 2.0, 3.0]
        else:
            assert not chunk.any()
    assert cache.page_address(2) - cache.page_address(0) == 2 * spec.page_bytes
    layer1_k_page2 = cache.pool[2, 1, 0, 1]
    assert torch.equal(layer1_k_page2, torch.full((2, 4), 2.0))
    assert torch.equal(cache.pool[4, 2, 1, 3], torch.full((2, 4), -3.0))
