"""The Triton paged attention (the CUDA platform's backend) equals the torch reference backends
on random pages, run on CPU tensors under TRITON_INTERPRET=1 in a subprocess (the variable must
be set before triton is imported): GQA (8 query heads per KV head of 128) and MLA (latent 512 +
rope 64), in the shapes whose prefill programs take a share of a KV head's query heads each,
fp32 / bf16 / FP8 pages, one ragged step of
decode rows (split over their pages), a fresh prefill chunk and a chunk over a cached prefix,
pages of 16 tokens; NaN bytes in slots a row does not own are never read, the null page stays
zero, and the new tokens' KV lands in the same bytes. On a CUDA machine, also on the GPU."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from tests.unit.triton_checks import DEVICES, run_check  # noqa: E402

CHECK = textwrap.dedent(
    """
    import torch
    from kvmesh.engine.attention import BatchLayout, get_backend
    from kvmesh.engine.attention.base import Slots
    from kvmesh.engine.kv.layout import KVCacheSpec, LayerKVSpec
    from kvmesh.engine.layers.mla import MlaWeights
    from kvmesh.engine.platform import for_device
    from kvmesh.engine.pool.kv_cache import PagedKVCache

    PAGE, PAGES, DEVICE = 16, 14, torch.device("{device}")
    # (cached tokens, new tokens) per chunk, decode rows first (3 pages, 2, 1), then a prompt's
    # first chunk and a chunk after 33 cached tokens
    ROWS = [(40, 1), (17, 1), (0, 1), (0, 20), (33, 9)]
    T = sum(w for _, w in ROWS)
    TABLES, USED = [], 0
    for start, width in ROWS:
        count = -(-(start + width) // PAGE)
        TABLES.append(tuple(range(USED, USED + count)))
        USED += count
    STARTS, WIDTHS = tuple(s for s, _ in ROWS), tuple(w for _, w in ROWS)

    def filled(kind, kv_dtype, dtype):
        if kind == "gqa":
            spec = KVCacheSpec.gqa(1, 2, 128, PAGE, kv_dtype)
        else:
            spec = KVCacheSpec((LayerKVSpec("mla", 1, 512 + 64),), PAGE, kv_dtype)
        pool = for_device(DEVICE).new_pool(spec, PAGES, False)
        kv = PagedKVCache(spec, PAGES, dtype, pool=pool)
        layer, head = kv.layers[0].layer, spec.layers[0]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(USED * PAGE, head.num_heads, head.parts, head.head_dim, generator=gen)
        slots = Slots.of(torch.arange(USED * PAGE, device=DEVICE), PAGE)
        layer.write(slots, (2 * x).bfloat16().to(DEVICE, dtype))  # equal values in either dtype
        nan = 127 if kv_dtype == "fp8_e4m3" else float("nan")  # 0x7f: e4m3fn's NaN
        for (start, width), table in zip(ROWS, TABLES):  # slots past each row's tokens
            layer.data[table[-1], :, (start + width - 1) % PAGE + 1 :] = nan
        kv.pool[USED] = 0xFF  # a page nobody in the step owns
        return kv, BatchLayout(3, tuple(TABLES), STARTS, WIDTHS, PAGE, kv.null_page)

    def inputs(kind, dtype):
        g = torch.Generator().manual_seed(1)
        rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
        if kind == "gqa":
            return (rand(T, 16, 128), rand(T, 2, 128), rand(T, 2, 128)), torch.tensor(0.1)
        return (rand(T, 4, 16), rand(T, 4, 64), rand(T, 576)), rand(4 * 32, 512) / 8

    def attend(name, kv, lay, args, extra):
        backend = get_backend(name, kv.spec.layers[0].kind, for_device(DEVICE))
        if kv.spec.layers[0].kind == "mla":
            extra = MlaWeights(extra, 4, 16, 16, 0.2)
        else:
            extra = extra.item()
        return backend.forward(*args, kv.layers[0], backend.build_metadata(lay), extra)

    CASES = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("bf16", torch.float32),
             ("fp8_e4m3", torch.float32), ("fp8_e4m3", torch.bfloat16)]
    for kind in ("gqa", "mla"):
        for kv_dtype, dtype in CASES:
            ref, lay = filled(kind, kv_dtype, torch.float32)  # the reference's maths in fp32
            kv, _ = filled(kind, kv_dtype, dtype)
            args, extra = inputs(kind, dtype)
            want = attend("torch", ref, lay, tuple(a.float() for a in args), extra.float())
            got = attend("triton", kv, lay, args, extra).float()
            case = (kind, kv_dtype, dtype)
            assert torch.isfinite(got).all(), case
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < (2e-6 if dtype == torch.float32 else 2e-2), (case, err)
            assert torch.equal(kv.pool, ref.pool), case  # the new tokens' KV: the same bytes
            assert not kv.pool[kv.null_page].any(), case
            print(case, f"{{err:.1e}}")
    print("ok")
    """
)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_attention_equals_the_torch_backends(device):
    run_check(CHECK, device)
