"""fp32 linears of a few rows on CPU as weight @ x^T (layers/linear.py WEIGHT_LEFT): taken for
2-64 rows of a large weight only, above the rows the fp32 GEMV kernel takes where it runs, the same product as torch's x @ W^T up to fp32 rounding, and
in the fused decode step the op eager runs (tests/integration/test_fused_decode.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.kernels import cpu_ops, kernel_isa
from kvmesh.engine.layers import linear

BIG = (4096, 1024)  # = WEIGHT_LEFT_MIN elements
# rows up to which the fp32 GEMV kernel (tests/unit/test_gemv_f32.py) comes first
GEMV_ROWS = linear.F32_GEMV_ROWS[kernel_isa()] if cpu_ops() is not None else 0


def test_fp32_picks_weight_left_for_two_to_sixty_four_rows_of_a_large_weight_only():
    big, small = torch.zeros(BIG), torch.zeros(1024, 1024)
    assert big.numel() == linear.WEIGHT_LEFT_MIN
    picked = {rows: linear.dense_kernel(rows, big) for rows in (1, 2, 3, 7, 11, 64, 65, 512)}
    want = {
        1: linear.TORCH,
        2: linear.WEIGHT_LEFT,
        3: linear.WEIGHT_LEFT,
        7: linear.WEIGHT_LEFT,
        11: linear.WEIGHT_LEFT,
        64: linear.WEIGHT_LEFT,
        65: linear.TORCH,
        512: linear.TORCH,
    }
    want.update({rows: linear.GEMV for rows in want if rows <= GEMV_ROWS})
    assert picked == want
    assert linear.dense_kernel(11, small) == linear.TORCH
    assert linear.dense_kernel(11, big.double()) == linear.TORCH


def test_weight_left_product_is_torchs_product_with_and_without_bias():
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(BIG, generator=gen), torch.randn(BIG[0], generator=gen)
    x = torch.randn(64, BIG[1], generator=gen)
    for rows in (max(2, GEMV_ROWS + 1), 11, 64):
        for b in (None, bias):
            got = linear.dense_matmul(x[:rows], w, b)
            assert got.shape == (rows, BIG[0]) and got.is_contiguous()
            taken = torch.mm(w, x[:rows].t()).t().contiguous()
            assert torch.equal(got, taken if b is None else taken + b)  # the path it takes
            want = (x[:rows].double() @ w.double().T + (0 if b is None else b.double())).float()
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-5)
            torch.testing.assert_close(got, F.linear(x[:rows], w, b), atol=2e-4, rtol=1e-5)
