"""Model sources -> (ModelConfig, HF-named float state dict)."""

from __future__ import annotations

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.gguf_loader import load_gguf
from kvmesh.engine.loader.resolve import DEFAULT_MODEL, ModelSource, resolve_model
from kvmesh.engine.loader.safetensors_loader import load_hf_folder

__all__ = ["DEFAULT_MODEL", "ModelSource", "load_weights", "resolve_model"]


def load_weights(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The weight-format registry: GGUF file or HF safetensors folder."""
    if source.gguf_file is not None:
        return load_gguf(source.gguf_file)
    assert source.hf_dir is not None
    return load_hf_folder(source.hf_dir)
