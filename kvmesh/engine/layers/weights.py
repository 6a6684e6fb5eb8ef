"""A model's view of its checkpoint: named tensors taken one at a time, with clear errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvmesh.engine.layers.linear import Source, dense
from kvmesh.errors import ModelFormatError


class Weights:
    """Tensors from a (possibly lazy) state dict. `raw` hands a tensor over as loaded and drops
    it from the mapping, so its memory goes once the model holds its own form; `dense` is that
    tensor in the compute dtype. The names taken are recorded (`taken`): what a model reads.

    With a pack-quantized checkpoint (`packed`: its compressed-tensors scheme), `X.weight` of a
    linear stored as X.weight_packed / weight_scale / weight_shape is that INT4 weight."""

    def __init__(self, state: Mapping[str, Any], dtype: torch.dtype, packed: Any = None) -> None:
        self.state, self.dtype, self.packed = state, dtype, packed
        self.taken: list[str] = []

    @property
    def partial(self) -> bool:
        """A pipeline stage's view (parallel/stage_state.py): its tables and norm may be absent."""
        return getattr(self.state, "partial", False)

    def __contains__(self, name: str) -> bool:
        return name in self.state or self._packed_base(name) is not None

    def _packed_base(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        if self.packed is None or base == name or f"{base}.weight_packed" not in self.state:
            return None
        return base

    def raw(self, name: str) -> Source:
        base = None if name in self.state else self._packed_base(name)
        if base is not None:
            from kvmesh.engine.quant.compressed_tensors import read_pack_quantized

            self.taken.extend(
                f"{base}.{s}" for s in ("weight_packed", "weight_scale", "weight_shape")
            )
            whole = getattr(self.state, "whole", self.state)  # a rank's view: read whole, then
            weight = read_pack_quantized(whole, base, self.packed)  # its part (whole groups)
            sliced = getattr(self.state, "sliced", None)
            return weight if sliced is None else sliced(f"{base}.weight", weight)
        if name not in self.state:
            raise ModelFormatError(f"weights lack tensor {name!r}")
        self.taken.append(name)
        pop = getattr(self.state, "pop", None)
        return pop(name) if pop is not None else self.state[name]

    def dense(self, name: str) -> torch.Tensor:
        if name in self.state and hasattr(self.state, "read"):  # a LazyWeights: cast as read,
            self.taken.append(name)  # so no full-size copy in the file's dtype is made
            return dense(self.state.pop(name, dtype=self.dtype), self.dtype)
        return dense(self.raw(name), self.dtype)

    def fp32(self, name: str) -> torch.Tensor:
        """A tensor the model keeps in float32 whatever its dtype (router weights and biases)."""
        return dense(self.raw(name), torch.float32)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.dense(name) if name in self.state else None

    def left_over(self) -> list[str]:
        """Names the model did not read (reported after a build)."""
        return sorted(self.state.keys())
