"""Model sources -> (ModelConfig, HF-named float state dict read tensor by tensor: a
`LazyWeights`). Importing this package does not import torch (the gateway and `kvmesh up` only
read configs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh import env
from kvmesh.config.engine import DEFAULT_MODEL
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.lazy_weights import LazyWeights
from kvmesh.engine.loader.model_cache import LoadedModel, cached_config, load_cached
from kvmesh.engine.loader.resolve import ModelSource, resolve_model
from kvmesh.engine.loader.tokenizer_cache import load_hf_tokenizer

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    Loader = Callable[[ModelSource, bool], tuple[ModelConfig, Mapping]]

__all__ = [
    "DEFAULT_MODEL",
    "LazyWeights",
    "LoadedModel",
    "ModelSource",
    "load_hf_tokenizer",
    "load_model",
    "load_weights",
    "read_config",
    "resolve_model",
]


def load_weights(source: ModelSource, int4: bool = False) -> tuple[ModelConfig, LazyWeights]:
    """The weight-format registry: GGUF file or HF safetensors folder, each tensor read when
    asked for (in the file's dtype; GGUF ones dequantized to float32). int4: GGUF Q4_0/Q4_1
    matrices stay INT4 (`Int4Weight`) instead of being dequantized."""
    if source.gguf_file is not None:
        from kvmesh.engine.loader.gguf_loader import load_gguf

        return load_gguf(source.gguf_file, int4)
    from kvmesh.engine.loader.safetensors_loader import load_hf_folder

    assert source.hf_dir is not None
    return load_hf_folder(source.hf_dir)


def load_model(
    source: ModelSource, int4: bool, dtype: str, load: Loader = load_weights
) -> LoadedModel:
    """`load` (`load_weights`) through the converted-model cache (GGUF sources;
    `KVMESH_MODEL_CACHE=0` turns it off): the same tensors, dense ones already in `dtype`
    ("fp32" / "bf16") -- what the model would cast them to."""
    if source.gguf_file is None or not env.model_cache():
        import time

        start = time.perf_counter()
        config, weights = load(source, int4)
        lazy = LazyWeights.of(weights)  # a substitute `load` may return a dict
        return LoadedModel(config, lazy, cache="off", seconds=time.perf_counter() - start)
    variant = "int4" if int4 else dtype
    return load_cached(source.gguf_file, variant, lambda: load(source, int4))


def read_config(source: ModelSource) -> ModelConfig:
    """The model's config without loading weights (for processes that only tokenize)."""
    if source.gguf_file is not None:
        if env.model_cache():
            return cached_config(source.gguf_file, lambda: _gguf_config(source))
        return _gguf_config(source)
    import json

    from kvmesh.engine.loader.hf_config import config_from_hf

    assert source.hf_dir is not None
    return config_from_hf(json.loads((source.hf_dir / "config.json").read_text()))


def _gguf_config(source: ModelSource) -> ModelConfig:
    from kvmesh.engine.loader.gguf_header import read_header
    from kvmesh.engine.loader.hf_config import config_from_gguf

    assert source.gguf_file is not None
    header = read_header(source.gguf_file)
    return config_from_gguf(header.metadata, header.lengths.get("tokenizer.ggml.tokens", 0))
