"""INT4 weight-only linear layers: quantization, GGUF Q4 blocks taken over exactly, and the CPU
kernel against the dequantized reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight


def _weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [32, 64])
def test_round_to_nearest_error_is_within_half_a_step(group):
    w = _weight()
    q = Int4Weight.quantize(w, group)
    step = q.scale.repeat_interleave(group, dim=1)
    assert q.q.max() <= 15 and q.shape == (96, 128)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_group_must_divide_the_inputs():
    with pytest.raises(ValueError, match="multiple of the group size"):
        Int4Weight.quantize(_weight(k=96), 64)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_blocks_are_taken_over_exactly(qtype):
    import gguf

    w = _weight(n=8, k=64).numpy()
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w, kind)
    reference = gguf.quants.dequantize(raw, kind).reshape(8, 64)
    ours = Int4Weight.from_gguf_blocks(raw, qtype, 8, 64)
    np.testing.assert_allclose(ours.dequantize().numpy(), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int4_linear_matches_the_dequantized_reference(dtype, tolerance):
    q = Int4Weight.cat([Int4Weight.quantize(_weight(seed=s), 32) for s in (1, 2)])  # fused rows
    layer = Int4Linear(q, dtype)
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = x.float() @ q.dequantize().t()
    got = layer(x).float()
    assert got.shape == (3, 5, 192)
    assert ((got - want).abs().max() / want.abs().max()).item() < tolerance
    element = torch.tensor([], dtype=dtype).element_size()
    assert layer.nbytes == 192 * 128 // 2 + (128 // 32) * 192 * 2 * element  # nibbles + (s, z)


def test_reordering_rows_moves_scales_with_them():
    q = Int4Weight.quantize(_weight(), 32)
    order = torch.arange(95, -1, -1)
    assert torch.equal(q.rows(order).dequantize(), q.dequantize()[order])
