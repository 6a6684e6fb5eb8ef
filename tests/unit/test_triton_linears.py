"""The CUDA platform's Triton linears equal the reference layers, on CPU tensors under
TRITON_INTERPRET=1 in a subprocess: the W4A16 GEMM over kvmesh's INT4 groups (the dequantized
weight's product; a CPU INT4 linear moved onto the device gives its values), and the
grouped-GEMM MoE (the expert loop of layers/moe.py), fp32 and bf16,
ragged batches (one row, rows that fill no block, many). On a CUDA machine, also on the GPU."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from tests.unit.triton_checks import DEVICES, run_check  # noqa: E402

CHECK = textwrap.dedent(
    """
    import torch
    from kvmesh.engine.layers.linear import DenseLinear
    from kvmesh.engine.layers.mlp import GatedMLP
    from kvmesh.engine.layers.moe import MoE
    from kvmesh.engine.layers.moe_grouped import GroupedExperts
    from kvmesh.engine.platform import for_device
    from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight
    from kvmesh.engine.quant.int4_cuda import CudaInt4Linear

    device = torch.device("{device}")
    gen = torch.Generator().manual_seed(0)
    tol = {{torch.float32: 2e-6, torch.bfloat16: 1e-2}}

    def close(got, want, case):
        err = ((got.float().cpu() - want).abs().max() / want.abs().max()).item()
        assert err < tol[case[-1]], (case, err)

    for n, k, group, rows, dtype in ((96, 128, 32, 5, torch.float32), (64, 64, 64, 1,
            torch.float32), (64, 256, 128, 33, torch.bfloat16), (48, 128, 32, 70, torch.float32)):
        weight = Int4Weight.quantize(torch.randn(n, k, generator=gen), group, search=False)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        layer = for_device(device).int4_linear(weight, dtype)
        close(layer(x.to(device)), x.float() @ weight.dequantize().t(), (n, k, group, rows, dtype))
        cpu = Int4Linear(weight, dtype)  # moved onto the device: the same weights
        if cpu.can_read_rows:
            moved = CudaInt4Linear.from_cpu(cpu, device)
            close(moved(x.to(device)), cpu(x).float(), ("moved", n, k, group, rows, dtype))

    E, H, I, top = 6, 32, 24, 2
    for tokens, dtype in ((1, torch.float32), (5, torch.float32), (40, torch.bfloat16)):
        experts = [GatedMLP(*(DenseLinear((torch.randn(*s, generator=gen) / 4).to(device, dtype))
                              for s in ((2 * I, H), (H, I)))) for _ in range(E)]
        x = torch.randn(tokens, H, generator=gen).to(device, dtype)
        ids = torch.stack([torch.randperm(E, generator=gen)[:top] for _ in range(tokens)])
        weights = torch.rand(tokens, top, generator=gen)
        ids, weights = ids.to(device), weights.to(device)
        want = MoE(None, experts, None)._expert_loop(x, ids, weights).float().cpu()
        close(GroupedExperts(experts)(x, ids, weights), want, ("moe", tokens, dtype))
    print("ok")
    """
)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_linears_equal_the_reference_layers(device):
    run_check(CHECK, device)
