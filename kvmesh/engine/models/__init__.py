"""Model architectures: `build_model` picks the implementation from the registry. Importing
this package (and models.registry) does not import torch: the gateway reads configs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvmesh.engine.models.registry import model_class

if TYPE_CHECKING:
    import torch

    from kvmesh.config import Int4Scheme
    from kvmesh.engine.config import ModelConfig
    from kvmesh.engine.models.base import CausalLM

__all__ = ["CausalLM", "build_model"]


def build_model(
    config: ModelConfig,
    weights: Mapping[str, Any],
    dtype: torch.dtype,
    max_positions: int,
    int4: Int4Scheme | None = None,
) -> CausalLM:
    return model_class(config.architecture)(config, weights, dtype, max_positions, int4)


def __getattr__(name: str) -> Any:
    if name == "CausalLM":
        from kvmesh.engine.models.base import CausalLM

        return CausalLM
    raise AttributeError(name)
