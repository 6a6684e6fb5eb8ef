"""The AMX bf16 linear (kernels/csrc/amx_linear.cpp) against a float64 reference, its bits the
same whatever the batch (1-64 rows), and dense_matmul's choice of kernel per batch size. Runs
where the CPU has AMX (Intel Xeon 4th generation on); elsewhere it skips, and dense_matmul uses
the GEMV up to 8 rows and torch above."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kernels import cpu_ops, has_amx
from kvmesh.engine.layers import linear

NO_AMX = pytest.mark.skipif(not has_amx(), reason="no AMX on this CPU (or no CPU kernels)")


def _case(n: int, k: int, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    return x, w, bias


@NO_AMX
@pytest.mark.parametrize("n,k", [(48, 576), (960, 576), (576, 1536), (16, 32)])
def test_amx_linear_matches_reference_and_is_the_same_bits_for_any_batch(n, k):
    x, w, bias = _case(n, k, 64, n + k)
    ops = cpu_ops()
    full = ops.linear_bf16_amx(x, w, bias)
    expected = (x.double() @ w.double().T + bias.double()).to(torch.bfloat16)
    torch.testing.assert_close(full, expected, atol=0.03, rtol=0.01)
    for rows in (1, 2, 5, 15, 16, 17, 31, 33, 48, 63):
        assert torch.equal(ops.linear_bf16_amx(x[:rows], w, bias), full[:rows]), rows
    alone = torch.cat([ops.linear_bf16_amx(x[i : i + 1], w, bias) for i in range(0, 64, 7)])
    assert torch.equal(alone, full[::7])
    no_bias = ops.linear_bf16_amx(x, w, None)
    torch.testing.assert_close(
        no_bias, (x.double() @ w.double().T).to(torch.bfloat16), atol=0.03, rtol=0.01
    )
    assert ops.linear_bf16_amx(x[:0], w, None).shape == (0, n)


@NO_AMX
def test_amx_linear_rejects_shapes_it_does_not_tile_with_a_message():
    ops = cpu_ops()
    for x, w in [
        (torch.zeros(65, 32), torch.zeros(16, 32)),  # more than 64 rows
        (torch.zeros(2, 40), torch.zeros(16, 40)),  # K not a multiple of 32
        (torch.zeros(2, 32), torch.zeros(20, 32)),
    ]:  # N not a multiple of 16
        with pytest.raises(RuntimeError, match="B <= 64, K % 32 == 0, N % 16 == 0"):
            ops.linear_bf16_amx(x.bfloat16(), w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.linear_bf16_amx(torch.zeros(2, 32), torch.zeros(16, 32), None)


@NO_AMX
def test_dense_matmul_picks_the_gemv_then_amx_then_torch_by_rows():
    """Rows 1-4: the GEMV's bits; 5-64: AMX's, the same for a row whatever the batch; above 64:
    torch's GEMM. A weight AMX cannot tile (N % 16 != 0) stays on the GEMV up to 8 rows."""
    ops = cpu_ops()
    x, w, bias = _case(960, 576, 80, 3)
    for rows in (1, 4):
        assert torch.equal(
            linear.dense_matmul(x[:rows], w, bias), ops.linear_bf16(x[:rows], w, bias)
        )
    amx = ops.linear_bf16_amx(x[:64], w, bias)
    for rows in (5, 9, 40, 64):
        assert torch.equal(linear.dense_matmul(x[:rows], w, bias), amx[:rows])
    big = linear.dense_matmul(x, w, bias)
    assert torch.equal(big, torch.nn.functional.linear(x, w, bias))
    odd = w[:952]
    assert torch.equal(linear.dense_matmul(x[:8], odd, None), ops.linear_bf16(x[:8], odd, None))


@pytest.mark.parametrize(
    "variables,on",
    [
        ({}, True),
        ({"KVMESH_AMX": "0"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
    ],
)
def test_amx_is_turned_off_by_its_flag_or_by_capping_onednn_below_amx(monkeypatch, variables, on):
    from kvmesh import env

    monkeypatch.delenv("KVMESH_AMX", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert env.amx_kernels() is on
