"""The Triton FP8 KV kernels (the CUDA path) produce the torch codec's values, run on CPU under
TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is imported); on a
CUDA machine they are also checked on the GPU."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from tests.unit.triton_checks import DEVICES, run_check  # noqa: E402

CHECK = textwrap.dedent(
    """
    import torch
    from kvmesh.engine.pool import kv_fp8
    from kvmesh.engine.kernels.gpu import kv_fp8 as kt
    device = "{device}"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-9, 7, 64).view(-1, 1, 1)
    x[5] = 0.0
    x[9, 0, 3] = 1e30
    want_q, want_e = kv_fp8.quantize(x)
    q, e = kt.quantize(x.to(device))
    q, e = q.cpu(), e.cpu()
    assert torch.equal(e, want_e), "exponents differ"
    got = q.view(torch.float8_e4m3fn).float()
    want = want_q.view(torch.float8_e4m3fn).float()
    assert torch.equal(got, want), "e4m3 values differ"
    assert ((q == want_q) | (got == 0)).all(), "bytes differ beyond the sign of zero"
    for dtype in (torch.float32, torch.bfloat16):
        out = kt.dequantize(want_q.to(device), want_e.to(device), dtype).cpu()
        assert torch.equal(out, kv_fp8.dequantize(want_q, want_e, dtype)), dtype
    print("ok")
    """
)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernels_match_the_torch_codec(device):
    run_check(CHECK, device)
