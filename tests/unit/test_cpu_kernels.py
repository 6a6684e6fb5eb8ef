"""The C++ CPU kernels against the torch reference: decode attention over random pages (GQA and
MLA, fp32 / bf16 / FP8 pages, fp32 / bf16 compute, contexts crossing and ending inside pages,
pages in random pool order), and the small-batch bf16 linear (fixed-order sums: a row's result
is the same bits whatever the batch or the thread count)."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.engine.attention import BatchLayout, get_backend
from kvmesh.engine.attention.base import Slots
from kvmesh.engine.kernels import cpu_ops, has_amx
from kvmesh.engine.kv.layout import KVCacheSpec, LayerKVSpec
from kvmesh.engine.layers.mla import MlaWeights
from kvmesh.engine.pool.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels do not run here")
LENGTHS = [1, 5, 16, 17, 40, 203]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _random_cache(spec: KVCacheSpec, dtype: torch.dtype, page: int, seed: int):
    """A pool whose pages are filled at random and handed to the rows in shuffled order."""
    pages = sum(-(-n // page) for n in LENGTHS) + 3
    cache = PagedKVCache(spec, pages, dtype)
    order = list(range(pages))
    random.Random(seed).shuffle(order)
    tables = []
    for n in LENGTHS:
        take = -(-n // page)
        tables.append(tuple(order[:take]))
        order = order[take:]
    gen = torch.Generator().manual_seed(seed)
    layer = cache.layers[0]
    for table, n in zip(tables, LENGTHS, strict=True):
        flat = torch.tensor(
            [table[i // page] * page + i % page for i in range(n - 1)], dtype=torch.long
        )
        slots = Slots.of(flat, page)
        if spec.layers[0].kind == "gqa":
            heads, dim = spec.layers[0].num_heads, spec.layers[0].head_dim
            k, v = (torch.randn(n - 1, heads, dim, generator=gen) * 2 for _ in range(2))
            layer.write(slots, k.to(dtype), v.to(dtype))
        else:
            layer.write(slots, torch.randn(n - 1, spec.layers[0].head_dim, generator=gen).to(dtype))
    rows = len(LENGTHS)
    layout = BatchLayout(
        rows, tuple(tables), tuple(n - 1 for n in LENGTHS), (1,) * rows, page, cache.null_page
    )
    return layer, layout, gen


def _both(kind, layout, *args):
    out = []
    for name in ("torch", "cpu"):
        backend = get_backend(name, kind)
        out.append(backend.forward(*args[:3], args[3], backend.build_metadata(layout), args[4]))
    return out


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,page", [(9, 3, 64, 16), (4, 4, 40, 8), (6, 1, 128, 16)]
)
def test_gqa_kernel_matches_reference(kv_dtype, dtype, heads, kv_heads, dim, page):
    spec = KVCacheSpec.gqa(1, kv_heads, dim, page, kv_dtype)
    layer, layout, gen = _random_cache(spec, dtype, page, seed=dim + heads)
    rows = len(LENGTHS)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    reference, kernel = _both("gqa", layout, q, k, v, layer, dim**-0.5)
    assert kernel.dtype == dtype and kernel.shape == reference.shape
    torch.testing.assert_close(
        kernel.float(), reference.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pages_give_the_bits_of_fp32_pages_holding_their_values(dtype):
    """The kernel applies an FP8 row's power-of-two scale once per token (to its score and its
    probability), not to every element: the same bits, as scaling by 2**e commutes with rounding."""
    layer8, layout, gen = _random_cache(KVCacheSpec.gqa(1, 3, 64, 16, "fp8_e4m3"), dtype, 16, 7)
    pages = layer8.layer.data.shape[0]
    cache32 = PagedKVCache(KVCacheSpec.gqa(1, 3, 64, 16, "fp32"), pages, dtype)
    every = Slots.of(torch.arange(pages * 16), 16)
    cache32.layers[0].write(every, *(x.float() for x in layer8.read(every)))  # exact values
    q = torch.randn(len(LENGTHS), 9, 64, generator=gen).to(dtype)
    k, v = (torch.randn(len(LENGTHS), 3, 64, generator=gen).to(dtype) for _ in range(2))
    backend = get_backend("cpu", "gqa")
    meta = backend.build_metadata(layout)
    from_fp8 = backend.forward(q, k, v, layer8, meta, 0.125)
    stored = [x.float() for x in layer8.as_stored(k, v)]  # the new token as FP8 holds it
    from_fp32 = backend.forward(q, *stored, cache32.layers[0], meta, 0.125)
    assert torch.equal(from_fp8, from_fp32)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,rope,heads", [(64, 16, 4), (512, 64, 16)])
def test_mla_kernel_matches_reference(kv_dtype, dtype, rank, rope, heads):
    nope, vdim, page = 16, 16, 16
    spec = KVCacheSpec((LayerKVSpec("mla", 1, rank + rope),), page, kv_dtype)
    layer, layout, gen = _random_cache(spec, dtype, page, seed=rank)
    w = MlaWeights(
        (torch.randn(heads * (nope + vdim), rank, generator=gen) * 0.1).to(dtype),
        heads,
        nope,
        vdim,
        (nope + rope) ** -0.5,
    )
    rows = len(LENGTHS)
    q_nope = torch.randn(rows, heads, nope, generator=gen).to(dtype)
    q_pe = torch.randn(rows, heads, rope, generator=gen).to(dtype)
    entry = torch.randn(rows, rank + rope, generator=gen).to(dtype)
    reference, kernel = _both("mla", layout, q_nope, q_pe, entry, layer, w)
    tol = TOLERANCE[dtype] * 2
    torch.testing.assert_close(kernel.float(), reference.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_the_same_page_bytes_as_the_torch_write(kv_dtype, dtype):
    spec = KVCacheSpec.gqa(2, 3, 40, 8, kv_dtype)
    torch_pages, kernel_pages = PagedKVCache(spec, 6, dtype), PagedKVCache(spec, 6, dtype)
    gen = torch.Generator().manual_seed(3)
    flat = torch.tensor([0, 9, 17, 40, 47], dtype=torch.long)  # pages 0, 1, 2, 5, 5
    slots = Slots.of(flat, 8)
    fresh = (torch.randn(5, 3, 2, 40, generator=gen) * 30).to(dtype)
    fresh[1, 2] = 0.0  # an all-zero row: exponent 0
    fresh[2, 0, 1, :3] = torch.tensor([1e-30, -5e4, 3e-3])  # subnormals and saturation's edge
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    lengths = torch.tensor([20], dtype=torch.int32)
    q = torch.randn(1, 6, 40, generator=gen).to(dtype)
    torch_pages.layers[1].layer.write(slots, fresh)
    layer = kernel_pages.layers[1].layer
    cpu_ops().paged_write_decode(
        q, fresh, layer.key, slots.page, slots.offset, tables, lengths, 1, 40, 0.1
    )
    assert torch.equal(kernel_pages.pool, torch_pages.pool)
    with pytest.raises(RuntimeError, match="outside the pages"):
        cpu_ops().paged_write_decode(
            q,
            fresh[:1],
            layer.key,
            torch.tensor([99]),
            torch.tensor([0]),
            tables,
            lengths,
            1,
            40,
            0.1,
        )


def test_decode_kernel_is_the_same_bits_for_any_thread_count_and_batch():
    spec = KVCacheSpec.gqa(1, 2, 64, 16, "fp8_e4m3")
    layer, layout, gen = _random_cache(spec, torch.bfloat16, 16, seed=7)
    q = torch.randn(len(LENGTHS), 4, 64, generator=gen).bfloat16()
    k = v = torch.randn(len(LENGTHS), 2, 64, generator=gen).bfloat16()
    backend = get_backend("cpu", "gqa")
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(backend.forward(q, k, v, layer, backend.build_metadata(layout), 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    last = BatchLayout(1, layout.block_tables[-1:], layout.starts[-1:], (1,), 16, layout.null_page)
    alone = backend.forward(q[-1:], k[-1:], v[-1:], layer, backend.build_metadata(last), 0.125)
    assert torch.equal(alone[0], outs[0][-1])


@pytest.mark.parametrize("n,k", [(49, 576), (64, 100), (1536, 33), (96, 1536)])
def test_small_batch_linear_matches_reference_and_is_batch_invariant(n, k):
    """1-8 rows: the GEMV; more: register tiles of 6 batch rows. Every row's bits are the same
    alone or in any batch (the tiles' transposed sums add in the GEMV's order)."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(64, k, generator=gen).bfloat16()
    ops = cpu_ops()
    full = ops.linear_bf16(x, w, bias)
    expected = (x.double() @ w.double().T + bias.double()).to(torch.bfloat16)
    torch.testing.assert_close(full, expected, atol=0.05, rtol=0.01)
    for rows in (*range(1, 22), 31, 40, 63):
        assert torch.equal(ops.linear_bf16(x[:rows], w, bias), full[:rows]), rows
    alone = torch.cat([ops.linear_bf16(x[i : i + 1], w, bias) for i in range(64)])
    assert torch.equal(alone, full)
    assert torch.equal(ops.linear_bf16(x[:3], w, None), ops.linear_bf16(x, w, None)[:3])
    assert ops.linear_bf16(x[:0], w, None).shape == (0, n)


@pytest.mark.skipif(has_amx(), reason="this CPU has AMX: test_amx_linear.py covers its choice")
def test_dense_matmul_without_amx_takes_the_gemv_up_to_its_tiled_rows_then_torch():
    from kvmesh.engine.kernels import kernel_isa
    from kvmesh.engine.layers import linear

    gen = torch.Generator().manual_seed(5)
    w, bias = torch.randn(960, 576, generator=gen).bfloat16(), torch.randn(960).bfloat16()
    x = torch.randn(600, 576, generator=gen).bfloat16()
    ops = cpu_ops()
    tiled = linear.TILED_ROWS[kernel_isa()]
    for rows in (1, 8, 9, 32, 33, 80, 600):
        expected = ops.linear_bf16 if rows <= tiled else torch.nn.functional.linear
        assert torch.equal(linear.dense_matmul(x[:rows], w, bias), expected(x[:rows], w, bias))
    if kernel_isa() == "avx2":  # no bf16 arithmetic: the GEMV at every batch, prefill too
        assert tiled > 600


def test_kernels_reject_bad_inputs_with_a_message():
    ops = cpu_ops()
    with pytest.raises(RuntimeError, match=r"x \[B, K\] and w \[N, K\]"):
        ops.linear_bf16(torch.zeros(9, 32).bfloat16(), torch.zeros(4, 16).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.linear_bf16(torch.zeros(1, 32), torch.zeros(4, 32), None)
    data = torch.zeros(2, 1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode(
            torch.zeros(1, 1, 8),
            data,
            None,
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.int32),
            0,
            1,
            8,
            1.0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(576, 576, 32), (192, 1536, 64), (64, 256, 128)])
def test_int4_small_batch_kernel_matches_torch_int4_kernel(dtype, n, k, group):
    from kvmesh.engine.quant.int4 import SMALL_BATCH, Int4Linear, Int4Weight

    gen = torch.Generator().manual_seed(k)
    layer = Int4Linear(Int4Weight.quantize(torch.randn(n, k, generator=gen), group), dtype)
    if layer._small_batch is None:
        pytest.skip("torch packs INT4 in another block size on this CPU")
    sz = layer.scales_zeros.double()
    weight = (layer_q(layer, n, k) - 8) * sz[..., 0].T.repeat_interleave(group, 1)
    weight += sz[..., 1].T.repeat_interleave(group, 1)
    x = torch.randn(SMALL_BATCH, k, generator=gen).to(dtype)
    exact = x.double() @ weight.T
    ops = cpu_ops()
    full = ops.int4_linear(x, layer.packed, group, layer.scales_zeros, layer.block)
    torch_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, layer.packed, group, layer.scales_zeros
    )
    scale = exact.abs().max()
    assert (full.double() - exact).abs().max() / scale <= (
        torch_kernel.double() - exact
    ).abs().max() / scale * 1.5 + 1e-6
    for rows in range(1, SMALL_BATCH):  # above 4 rows a block 4 at a time: the same sums
        assert torch.equal(
            ops.int4_linear(x[:rows], layer.packed, group, layer.scales_zeros, layer.block),
            full[:rows],
        )


def layer_q(layer, n: int, k: int) -> torch.Tensor:
    from kvmesh.engine.quant.int4 import read_nibbles

    return read_nibbles(layer.packed, layer.block, torch.arange(n), k).double()


@pytest.mark.parametrize("dim", [576, 64, 100])
def test_bf16_rms_norm_kernel_is_the_same_bits_as_hf(dim):
    from kvmesh.engine.layers.norm import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(37, dim, generator=gen) * 3).bfloat16()
    delta = torch.randn(37, dim, generator=gen).bfloat16()
    weight = (torch.rand(dim, generator=gen) + 0.5).bfloat16()

    def hf(h):  # transformers' LlamaRMSNorm.forward
        f = h.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()

    assert torch.equal(rms_norm(x, weight, 1e-5), hf(x))
    normed, total = add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta) and torch.equal(normed, hf(x + delta))
    assert torch.equal(rms_norm(x.view(37, 1, dim), weight, 1e-5), hf(x).view(37, 1, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
def test_rope_kernel_is_the_same_bits_as_the_torch_expression(dtype, dim):
    from kvmesh.engine.models import rope

    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(7, 15 * dim, generator=gen).to(dtype)
    q, k = qkv[:, : 9 * dim].view(7, 9, dim), qkv[:, 9 * dim : 12 * dim].view(7, 3, dim)
    angle = torch.randn(7, dim // 2, generator=gen)
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype).unsqueeze(1)
    sin = torch.cat([angle.sin()] * 2, -1).to(dtype).unsqueeze(1)
    assert rope._kernel_fits(q, cos, sin)
    for x in (q, k):  # strided views of one fused projection, as the layers pass them
        half = dim // 2
        expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
        assert torch.equal(rope.apply_rotary(x, cos, sin), expected)


def test_loading_the_kernels_resolves_amx_so_graphs_read_a_plain_value():
    """A compiled step must not call the has_amx op while dynamo traces it (a graph break that
    failed bf16 graphs in a fresh process): resolving the kernels resolves it."""
    import subprocess
    import sys

    code = "from kvmesh.engine import kernels; kernels.cpu_ops(); print(len(kernels._AMX))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [49152, 1000, 17, 5])
def test_argmax_kernel_is_torch_argmax(dtype, width):
    """The first index of the maximum, as torch.argmax, through ties, signed zeros, infinities
    and odd widths; a row holding a NaN anywhere is reported as -1 (the sampler's fallback)."""
    gen = torch.Generator().manual_seed(width)
    logits = (torch.randn(12, width, generator=gen) * 4).to(dtype)
    logits[1] = logits[1].round()  # many ties at the top
    logits[2] = -logits[2].abs() - 1  # all negative
    logits[3] = float("-inf")
    logits[4, :] = 0.0
    logits[4, width // 2 :] = -0.0
    logits[5, width - 1] = logits[5].max() + 1  # the maximum in the tail
    logits[6, 0] = -0.0  # -0.0 first, +0.0 later, both the maximum
    logits[6, 1:] = -1.0
    logits[6, width - 1] = 0.0
    logits[7, width // 3] = float("inf")
    logits[8, width - 1] = float("nan")
    logits[9, 0] = -float("nan")
    logits[10, width // 2] = float("-nan")
    out = cpu_ops().argmax_rows(logits)
    nan_rows = logits.isnan().any(-1)
    assert out[nan_rows].eq(-1).all()
    assert torch.equal(out[~nan_rows], logits[~nan_rows].argmax(-1))
    assert nan_rows.tolist() == [False] * 8 + [True, True, True, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_token_ids_are_torch_argmax_nan_rows_too(dtype):
    """The sampler's list-returning argmax: the kernel's answer, or torch's where a row holds
    a NaN (the kernel's -1 is never returned)."""
    from kvmesh.engine.runner.sampler import greedy_token_ids, greedy_tokens

    logits = (torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    assert greedy_token_ids(logits) == logits.argmax(-1).tolist() == greedy_tokens(logits).tolist()
    logits[4, 17] = float("nan")
    assert greedy_token_ids(logits) == logits.argmax(-1).tolist() == greedy_tokens(logits).tolist()
    assert greedy_token_ids(logits)[4] == 17 and greedy_token_ids(logits[:0]) == []


@pytest.mark.parametrize("rows, width", [(7, 8200), (1, 1536), (40, 1536)])
def test_silu_mul_is_whole_rows_of_torchs_silu_at_any_thread_count(rows, width):
    """ops.silu_mul splits by whole rows, so its bits are each row's torch silu * up alone, at
    any thread count (torch's own split of a large tensor lands mid-row, and its vector loop then
    leaves other lanes to the scalar exp); the fused step's 64-column ranges give those bits."""
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    want = torch.stack([torch.nn.functional.silu(gate[r]) * up[r] for r in range(rows)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_ops().silu_mul(gate_up), want), threads
    finally:
        torch.set_num_threads(before)
