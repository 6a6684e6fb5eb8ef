"""The ONE architecture registry, keyed by HF `architectures` names (pure Python: the gateway
and the launcher read it without torch). GGUF `general.architecture` names map into it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvmesh.errors import ModelFormatError


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # e.g. DeepseekV3ForCausalLM
    family: str  # ModelConfig.architecture: llama, qwen3, deepseek_v3, ...
    target: str  # "module:class" implementing models.base.CausalLM, imported on first use


_ENTRIES = (
    Architecture("LlamaForCausalLM", "llama", "kvmesh.engine.models.llama:LlamaModel"),
    Architecture("MistralForCausalLM", "mistral", "kvmesh.engine.models.llama:LlamaModel"),
    Architecture("Qwen2ForCausalLM", "qwen2", "kvmesh.engine.models.llama:LlamaModel"),
    Architecture("Qwen3ForCausalLM", "qwen3", "kvmesh.engine.models.llama:LlamaModel"),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "kvmesh.engine.models.moe:MoeModel"),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", "kvmesh.engine.models.moe:MoeModel"),
    Architecture("Glm4MoeForCausalLM", "glm4_moe", "kvmesh.engine.models.moe:MoeModel"),
    Architecture("Glm4MoeLiteForCausalLM", "glm4_moe_lite", "kvmesh.engine.models.moe:MoeModel"),
    Architecture("GlmMoeDsaForCausalLM", "glm_moe_dsa", "kvmesh.engine.models.moe:MoeModel"),
)
ARCHITECTURES = {a.hf_name: a for a in _ENTRIES}
_BY_FAMILY = {a.family: a for a in _ENTRIES}
GGUF_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def by_hf_names(names: list[str]) -> Architecture:
    """The first of a config's `architectures` that kvmesh implements."""
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ModelFormatError(f"unsupported architecture {names}; supported: {sorted(ARCHITECTURES)}")


def by_family(family: str) -> Architecture:
    if family not in _BY_FAMILY:
        raise ModelFormatError(f"no implementation for architecture {family!r}")
    return _BY_FAMILY[family]


def model_class(family: str) -> type:
    module, cls = by_family(family).target.split(":")
    return getattr(importlib.import_module(module), cls)
