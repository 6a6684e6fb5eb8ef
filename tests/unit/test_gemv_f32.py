"""The small-batch fp32 linear (kernels/csrc/gemv_f32.cpp) against a float64 reference: the sums
in a fixed order, so a row's result is the same bits whatever the batch or the thread count,
and `dense_matmul` takes it for fp32 weights up to F32_GEMV_ROWS rows."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kernels import cpu_ops, kernel_isa
from kvmesh.engine.layers import linear

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels do not run here")


@pytest.mark.parametrize("n,k", [(49, 576), (64, 100), (1536, 33), (96, 1536), (3, 7)])
def test_fp32_gemv_matches_float64_and_is_batch_and_thread_invariant(n, k):
    gen = torch.Generator().manual_seed(n * k)
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    most = linear.F32_GEMV_ROWS[kernel_isa()]
    x = torch.randn(most, k, generator=gen)
    ops = cpu_ops()
    full = ops.linear_f32(x, w, bias)
    expected = (x.double() @ w.double().T + bias.double()).float()
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-5)
    for rows in range(1, most + 1):
        assert torch.equal(ops.linear_f32(x[:rows], w, bias), full[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.linear_f32(x, w, bias), full)
    finally:
        torch.set_num_threads(threads)
    no_bias = ops.linear_f32(x, w, None)
    torch.testing.assert_close(no_bias + bias, full, atol=1e-5, rtol=1e-6)
    assert ops.linear_f32(x[:0], w, None).shape == (0, n)


def test_dense_matmul_takes_the_fp32_gemv_up_to_its_rows_then_torch():
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen)
    x = torch.randn(40, 576, generator=gen)
    ops, most = cpu_ops(), linear.F32_GEMV_ROWS[kernel_isa()]
    for rows in (1, 2, most, most + 1, 40):
        got = linear.dense_matmul(x[:rows], w, bias)
        if rows <= most:
            assert linear.dense_kernel(rows, w) == linear.GEMV
            assert torch.equal(got, ops.linear_f32(x[:rows], w, bias))
        else:
            assert linear.dense_kernel(rows, w) != linear.GEMV
            assert torch.equal(got, torch.nn.functional.linear(x[:rows], w, bias))


def test_fp32_gemv_rejects_bad_inputs_with_a_message():
    ops, most = cpu_ops(), linear.F32_GEMV_ROWS[kernel_isa()]
    with pytest.raises(RuntimeError, match="fp32 inputs only"):
        ops.linear_f32(torch.zeros(1, 32).bfloat16(), torch.zeros(4, 32).bfloat16(), None)
    with pytest.raises(RuntimeError, match=f"at most {most} rows"):
        ops.linear_f32(torch.zeros(most + 1, 32), torch.zeros(4, 32), None)
    with pytest.raises(RuntimeError, match=r"x \[B, K\] and w \[N, K\]"):
        ops.linear_f32(torch.zeros(1, 32), torch.zeros(4, 16), None)
