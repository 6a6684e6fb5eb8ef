"""Model sources -> (ModelConfig, HF-named float state dict)."""

from __future__ import annotations

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.gguf_loader import load_gguf
from kvmesh.engine.loader.resolve import DEFAULT_MODEL, ModelSource, resolve_model
from kvmesh.engine.loader.safetensors_loader import load_hf_folder

__all__ = ["DEFAULT_MODEL", "ModelSource", "load_weights", "read_config", "resolve_model"]


def load_weights(
    source: ModelSource, int4: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The weight-format registry: GGUF file or HF safetensors folder. int4: GGUF Q4_0/Q4_1
    matrices stay INT4 (`Int4Weight`) instead of being dequantized."""
    if source.gguf_file is not None:
        return load_gguf(source.gguf_file, int4)
    assert source.hf_dir is not None
    return load_hf_folder(source.hf_dir)


def read_config(source: ModelSource) -> ModelConfig:
    """The model's config without loading weights (for processes that only tokenize)."""
    if source.gguf_file is not None:
        from kvmesh.engine.loader.gguf_loader import gguf_metadata, open_gguf
        from kvmesh.engine.loader.hf_config import config_from_gguf

        reader = open_gguf(source.gguf_file)
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        return config_from_gguf(gguf_metadata(reader), len(tokens.data) if tokens else 0)
    import json

    from kvmesh.engine.loader.hf_config import config_from_hf

    assert source.hf_dir is not None
    return config_from_hf(json.loads((source.hf_dir / "config.json").read_text()))
