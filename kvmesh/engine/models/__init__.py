"""Model architectures: `build_model` picks the implementation from the registry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvmesh.engine.config import Int4Scheme, ModelConfig
from kvmesh.engine.models.base import CausalLM
from kvmesh.engine.models.registry import model_class

__all__ = ["CausalLM", "build_model"]


def build_model(
    config: ModelConfig,
    weights: Mapping[str, Any],
    dtype: torch.dtype,
    max_positions: int,
    int4: Int4Scheme | None = None,
) -> CausalLM:
    return model_class(config.architecture)(config, weights, dtype, max_positions, int4)
