"""Model architectures by family name (the registry the loader's config selects from)."""

from __future__ import annotations

import torch

from kvmesh.engine.config import Int4Scheme, ModelConfig
from kvmesh.engine.models.llama import LlamaModel
from kvmesh.errors import ModelFormatError

_ARCHITECTURES = {"llama": LlamaModel, "qwen2": LlamaModel, "mistral": LlamaModel}


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    max_positions: int,
    int4: Int4Scheme | None = None,
) -> LlamaModel:
    cls = _ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise ModelFormatError(f"no implementation for architecture {config.architecture!r}")
    return cls(config, weights, dtype, max_positions, int4)
