"""Build a ModelConfig from GGUF metadata or an HF config.json."""

from __future__ import annotations

from typing import Any

from kvmesh.engine.config import ModelConfig, RopeScaling
from kvmesh.errors import ModelFormatError

SUPPORTED_ARCHS = {"llama", "qwen2", "mistral"}
_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    if arch is None:
        raise ModelFormatError(f"unsupported architecture {archs}; supported: {sorted(_HF_ARCHS)}")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", arch == "qwen2"),
        rope_scaling=_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
    )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ModelFormatError(f"unsupported rope scaling {kind!r}")
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position=int(raw.get("original_max_position_embeddings", 8192)),
    )


def config_from_gguf(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHS)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFormatError(f"GGUF metadata lacks {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings=True,  # corrected by the loader when an output.weight exists
        attention_bias=arch == "qwen2",
        rope_scaling=_rope_scaling(
            {"type": scaling, "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
            if scaling in ("linear",)
            else None
        ),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
