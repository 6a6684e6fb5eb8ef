"""The page pool layout: one physical page is one contiguous byte range holding every layer,
in the KV dtype, with FP8 scales inside the same page."""

from __future__ import annotations

import pytest
import torch

from kvmesh.config.engine import parse_size
from kvmesh.engine.attention import AttentionMetadata, Slots
from kvmesh.engine.attention.torch_backend import TorchAttention
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.pool.kv_cache import PagedKVCache
from kvmesh.engine.pool.kv_fp8 import dequantize, quantize

SLOTS = torch.tensor([2 * 4 + 1, 4 * 4 + 3])  # page 2 offset 1, page 4 offset 3


def _write_layers(cache: PagedKVCache) -> None:
    meta = AttentionMetadata(Slots.of(SLOTS, 4), 0, None, None, ())
    for layer, kv in enumerate(cache.layers):
        k = torch.full((2, 2, 4), float(layer + 1))
        TorchAttention().forward(k.repeat(1, 2, 1), k, -k, kv, meta, 1.0)


def test_written_kv_lands_inside_its_page_bytes():
    spec = KVCacheSpec.gqa(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, kv_dtype="fp32")
    cache = PagedKVCache(spec, num_pages=5)
    _write_layers(cache)
    pages = cache.pool.view(torch.float32).view(
        7, 2, 3, 4, 2, 4
    )  # [page, head, layer, slot, k|v, ..]
    assert cache.null_page == 5 and not pages[5].any()  # the null page: zeros nothing writes
    assert cache.scratch_page == 6 and not pages[6].any()  # written by compiled padding only
    for page in range(5):
        values = sorted(set(pages[page].abs().flatten().tolist()))
        assert values == ([0.0, 1.0, 2.0, 3.0] if page in (2, 4) else [0.0])
    assert cache.page_address(2) - cache.page_address(0) == 2 * spec.page_bytes
    assert torch.equal(pages[2, :, 1, 1, 0], torch.full((2, 4), 2.0))
    assert torch.equal(pages[4, :, 2, 3, 1], torch.full((2, 4), -3.0))
    head_block = spec.page_bytes // 2  # a head's KV of every layer is one byte range
    assert torch.equal(cache.pool[2, :head_block].view(torch.float32).view(3, 4, 2, 4), pages[2, 0])


def test_fp8_page_holds_its_scales_and_reads_back_within_e4m3_precision():
    spec = KVCacheSpec.gqa(
        num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, kv_dtype="fp8_e4m3"
    )
    assert spec.page_bytes == 3 * 2 * 4 * 2 * (4 + 1)
    cache = PagedKVCache(spec, num_pages=5)
    _write_layers(cache)
    untouched = [p for p in range(5) if p not in (2, 4)]
    assert not cache.pool[untouched].any()  # every byte written (data and scale) is in its page
    for layer, kv in enumerate(cache.layers):
        k, v = kv.read(Slots.of(SLOTS, 4))
        assert torch.equal(k, torch.full((2, 2, 4), float(layer + 1)))  # 1, 2, 3 are exact
        assert torch.equal(v, -k)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 4, generator=gen) * 37.0
    cache.layers[0].write(Slots.of(SLOTS, 4), x, x)
    k, _ = cache.layers[0].read(Slots.of(SLOTS, 4))
    amax = x.abs().amax(-1, keepdim=True)
    assert ((k - x).abs() <= amax / 16).all()  # e4m3: 3 mantissa bits


def test_fp8_page_is_about_half_a_bf16_page():
    bf16 = KVCacheSpec.gqa(30, 3, 64, 16, "bf16")
    fp8 = KVCacheSpec.gqa(30, 3, 64, 16, "fp8_e4m3")
    assert bf16.page_bytes == 368_640
    assert fp8.page_bytes == 187_200
    assert 1.96 < bf16.page_bytes / fp8.page_bytes < 1.98
    budget = 256 << 20
    assert fp8.pages_for_budget(budget) / bf16.pages_for_budget(budget) > 1.95


def test_dequantize_is_the_exact_inverse_of_torchs_e4m3_cast():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.int8)
    reference = codes.view(torch.float8_e4m3fn).float()
    ours = dequantize(codes, torch.zeros((), dtype=torch.int8), torch.float32)
    finite = ~reference.isnan()
    assert torch.equal(ours[finite], reference[finite])  # subnormals included
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 3, 64, generator=gen) * torch.logspace(-8, 6, 512).view(-1, 1, 1)
    q, e = quantize(x)
    expected = q.view(torch.float8_e4m3fn).float() * torch.exp2(e.float()).unsqueeze(-1)
    assert torch.equal(dequantize(q, e, torch.float32), expected)
    assert (q.view(torch.float8_e4m3fn).float().abs().amax(-1) >= 224).all()  # range used
    assert torch.equal(
        dequantize(*quantize(torch.zeros(2, 64)), torch.bfloat16), torch.zeros(2, 64)
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 << 20),
        ("2GiB", 2 << 30),
        ("512M", 512 << 20),
        ("1.5G", 3 << 29),
        ("4096", 4096),
        ("64kib", 64 << 10),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "0"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)
