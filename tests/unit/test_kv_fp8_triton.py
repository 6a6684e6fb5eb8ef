"""The Triton FP8 KV kernels (the CUDA path) produce the torch codec's values, run on CPU under
TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is imported); on a
CUDA machine they are also checked on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

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


def _run(device: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    return subprocess.run(
        [sys.executable, "-c", CHECK.format(device=device)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_triton_kernels_match_the_torch_codec_under_the_interpreter():
    result = _run("cpu", interpret=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_match_the_torch_codec_on_cuda():
    result = _run("cuda", interpret=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
