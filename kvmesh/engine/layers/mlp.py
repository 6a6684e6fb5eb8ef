"""The gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.layers.linear import Linear, LinearMethod
from kvmesh.engine.layers.weights import Weights
from kvmesh.engine.platform import kernels_for


class GatedMLP:
    def __init__(self, gate_up: Linear, down: Linear) -> None:
        self.gate_up, self.down = gate_up, down

    @classmethod
    def load(cls, weights: Weights, prefix: str, method: LinearMethod) -> GatedMLP:
        """From `prefix`{gate,up,down}_proj.weight."""
        parts = [weights.raw(f"{prefix}{n}_proj.weight") for n in ("gate", "up")]
        down = method.create([weights.raw(f"{prefix}down_proj.weight")], None)
        return cls(method.create(parts, None), down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_mul(self.gate_up(x)))

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate|up output; one kernels op on CPU, the same bits."""
    ops = kernels_for(gate_up)
    if ops is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
