"""The attention backends over paged KV (torch reference, and the CPU kernels where they run): a decode row never reads what lies in slots it
does not own (its padding points at the pool's null page), even NaN bytes; MLA's absorbed decode equals attention over the
expanded keys and values."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.attention import BatchLayout, get_backend
from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.kv.layout import KVCacheSpec, LayerKVSpec
from kvmesh.engine.layers.mla import MlaWeights
from kvmesh.engine.pool.kv_cache import PagedKVCache

PAGE = 4
BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(cpu_ops() is None, reason="no CPU kernels here")),
]


def _layout(lengths: list[int], tables: list[tuple[int, ...]], null: int) -> BatchLayout:
    """Decode rows whose contexts (lengths - 1 tokens) are already cached."""
    n = len(lengths)
    return BatchLayout(n, tuple(tables), tuple(x - 1 for x in lengths), (1,) * n, PAGE, null)


def _poison(cache: PagedKVCache, page: int) -> None:
    cache.pool[page] = torch.full((cache.spec.page_bytes,), 0xFF, dtype=torch.uint8)  # NaNs


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_ignores_nan_in_padding_slots(dtype, name):
    cache = PagedKVCache(KVCacheSpec.gqa(1, 2, 8, PAGE, "fp32"), 8, dtype)
    backend = get_backend(name, "gqa")
    gen = torch.Generator().manual_seed(0)
    layer = cache.layers[0]
    data = layer.layer.data  # [page, head, slot, k|v, dim]
    for page in (1, 2, 3):  # row 0: pages 1, 2 (6 tokens); row 1: page 3 (2 tokens)
        x = torch.randn(2, PAGE, 8, generator=gen)
        data[page, :, :, 0], data[page, :, :, 1] = x, -x
    layout = _layout([6, 2], [(1, 2), (3,)], cache.null_page)
    q = torch.randn(2, 4, 8, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, 2, 8, generator=gen, dtype=dtype) for _ in range(2))
    clean = backend.forward(q, k, v, layer, backend.build_metadata(layout), 0.3)
    _poison(cache, 0)  # another request's page
    for page in (2, 3):  # slots 2, 3 of each row's last page are unwritten
        data[page, :, 2:] = float("nan")
    dirty = backend.forward(q, k, v, layer, backend.build_metadata(layout), 0.3)
    assert torch.isfinite(dirty).all() and torch.equal(clean, dirty)
    assert not cache.pool[cache.null_page].any()  # padding reads zeros nothing wrote


@pytest.mark.parametrize("name", BACKENDS)
def test_mla_absorbed_decode_equals_expanded_attention_and_ignores_padding(name):
    rank, rope, heads, nope, vdim = 16, 8, 3, 6, 5
    spec = KVCacheSpec((LayerKVSpec("mla", 1, rank + rope),), PAGE, "fp32")
    cache = PagedKVCache(spec, 8)
    backend = get_backend(name, "mla")
    gen = torch.Generator().manual_seed(1)
    w = MlaWeights(torch.randn(heads * (nope + vdim), rank, generator=gen), heads, nope, vdim, 0.4)
    context = torch.randn(7, rank + rope, generator=gen)  # row 0's 7 cached tokens
    data = cache.layers[0].layer.data  # [page, 1, slot, 1, rank + rope]
    data[1, 0, :, 0] = context[:4]
    data[2, 0, :3, 0] = context[4:]
    _poison(cache, 0)
    layout = _layout([8, 1], [(1, 2), (3,)], cache.null_page)
    q_nope, q_pe = (
        torch.randn(2, heads, nope, generator=gen),
        torch.randn(2, heads, rope, generator=gen),
    )
    entry = torch.randn(2, rank + rope, generator=gen)
    out = backend.forward(q_nope, q_pe, entry, cache.layers[0], backend.build_metadata(layout), w)
    every = torch.cat([context, entry[:1]])  # row 0 sees its 7 cached tokens and itself
    kv = torch.nn.functional.linear(every[:, :rank], w.kv_b).view(8, heads, nope + vdim)
    keys = torch.cat([kv[..., :nope], every[:, None, rank:].expand(-1, heads, -1)], -1)
    query = torch.cat([q_nope[0], q_pe[0]], -1)
    probs = (torch.einsum("hd,lhd->hl", query, keys) * 0.4).softmax(-1)
    expected = torch.einsum("hl,lhv->hv", probs, kv[..., nope:])
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", BACKENDS)
def test_decode_tables_as_one_array_give_the_metadata_and_output_of_tuples(name):
    """The runner passes a decode-only step's tables as one null-padded array (its persistent
    rows); each backend must read it as it reads tuples, and the paged one refuses a row whose
    new token would land in the null page."""
    import numpy as np

    from kvmesh.engine.pool.block_tables import BlockTables

    cache = PagedKVCache(KVCacheSpec.gqa(1, 2, 8, PAGE, "fp32"), 8)
    backend = get_backend(name, "gqa")
    gen = torch.Generator().manual_seed(1)
    cache.layers[0].layer.data[1:5] = torch.randn(4, 2, PAGE, 2, 8, generator=gen)
    rows = BlockTables(cache.null_page, rows=1, width=1)  # both grow here
    for req_id, table in (("a", (1, 2)), ("b", (4,)), ("c", (3, 2, 1))):
        rows.add(req_id, table, (7,) * len(table))
    lengths = [6, 3, 9]
    array = rows.gather(rows.rows(["a", "b", "c"]), 3)
    assert array.tolist() == [
        [1, 2, cache.null_page],
        [4, cache.null_page, cache.null_page],
        [3, 2, 1],
    ]
    as_array = BatchLayout(3, array, tuple(x - 1 for x in lengths), (1,) * 3, PAGE, cache.null_page)
    as_tuples = _layout(lengths, [(1, 2), (4,), (3, 2, 1)], cache.null_page)
    q = torch.randn(3, 4, 8, generator=gen)
    k, v = (torch.randn(3, 2, 8, generator=gen) for _ in range(2))
    meta = [backend.build_metadata(x) for x in (as_array, as_tuples)]
    assert torch.equal(meta[0].slot_mapping.page, meta[1].slot_mapping.page)
    assert torch.equal(meta[0].slot_mapping.offset, meta[1].slot_mapping.offset)
    before = cache.layers[0].layer.data.clone()
    out = [backend.forward(q, k, v, cache.layers[0], m, 0.3) for m in meta]
    assert torch.equal(out[0], out[1])
    assert not torch.equal(before, cache.layers[0].layer.data)  # the new KV was written
    if name == "cpu":
        short = BatchLayout(1, array[1:2], (PAGE,), (1,), PAGE, cache.null_page)  # past page 4
        with pytest.raises(ValueError, match="past its block table"):
            backend.build_metadata(short)
    assert np.array_equal(rows.gather(rows.rows(["b"]), 2), [[4, cache.null_page]])
