"""Routed experts as one grouped GEMM per projection (kernels/gpu/moe.py): the CUDA
platform's MoE, and `--moe-backend triton` (on CPU only under TRITON_INTERPRET=1). Dense
experts only: each projection's weights stacked [E, N, K]."""

from __future__ import annotations

import torch

from kvmesh.engine.kernels.gpu.moe import align, grouped_gemm
from kvmesh.engine.layers.linear import DenseLinear
from kvmesh.engine.layers.mlp import GatedMLP, silu_mul
from kvmesh.errors import InvalidRequestError


class GroupedExperts:
    def __init__(self, experts: list[GatedMLP | None]) -> None:
        if not experts or any(not _dense(e) for e in experts):
            raise InvalidRequestError(
                "the grouped (Triton) MoE takes dense experts of one rank: not INT4 ones, "
                "not expert-parallel shares"
            )
        self.gate_up = torch.stack([e.gate_up.weight for e in experts])  # [E, 2I, H]
        self.down = torch.stack([e.down.weight for e in experts])  # [E, H, I]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum per token [T, H] fp32."""
        sorted_ids, block_expert = align(ids, self.gate_up.shape[0])
        routing = (sorted_ids, block_expert, ids.numel())
        hidden = silu_mul(grouped_gemm(x.contiguous(), self.gate_up, routing))
        pairs = grouped_gemm(hidden, self.down, routing, weights.flatten(), torch.float32)
        return pairs.view(*ids.shape, -1).sum(1)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def _dense(mlp: GatedMLP | None) -> bool:
    return (
        mlp is not None
        and isinstance(mlp.gate_up, DenseLinear)
        and isinstance(mlp.down, DenseLinear)
        and mlp.gate_up.bias is None
        and mlp.down.bias is None
    )


def group_experts(model) -> int:
    """Every MoE layer of `model` on grouped experts; how many there were."""
    from kvmesh.engine.layers.moe import MoE

    layers = [layer.mlp for layer in getattr(model, "layers", ()) if isinstance(layer.mlp, MoE)]
    for moe in layers:
        moe.group(GroupedExperts)
    return len(layers)
