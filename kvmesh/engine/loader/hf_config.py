"""Build a ModelConfig from GGUF metadata or an HF config.json."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.engine.config import IndexerConfig, MlaConfig, ModelConfig, MoeConfig, RopeScaling
from kvmesh.engine.models.registry import GGUF_NAMES, by_hf_names
from kvmesh.errors import ModelFormatError

SUPPORTED_ARCHS = set(GGUF_NAMES)
_QK_NORM = {"qwen3", "qwen3_moe"}
# Methods that describe where float tensors came from, not how they are stored (transformers
# writes quant_method "gguf" when it saves a model it dequantized from a GGUF).
_DEQUANTIZED = {"gguf"}


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    arch = by_hf_names(cfg.get("architectures") or []).family
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    mla = _mla(cfg)
    head_dim = mla.qk_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads if mla else cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", arch == "qwen2"),
        rope_scaling=_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        qk_norm=arch in _QK_NORM or bool(cfg.get("use_qk_norm")),
        rotary_dim=0 if mla or partial == 1.0 else int(head_dim * partial),
        rope_interleave=bool(mla) and cfg.get("rope_interleave", True),
        mla=mla,
        moe=_moe(arch, cfg),
        indexer=IndexerConfig(cfg["index_topk"]) if "index_topk" in cfg else None,
        sliding_window=_sliding_window(cfg),
        quantization_config=_quantization(cfg),
    )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """Mistral's window; Qwen2/3 write one and turn it off with use_sliding_window."""
    window = cfg.get("sliding_window")
    return int(window) if window and cfg.get("use_sliding_window", True) else None


def _quantization(cfg: dict[str, Any]) -> str:
    """The checkpoint's own quantization, if it is one the engine loads (else an error)."""
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    if not quant or quant.get("quant_method") in _DEQUANTIZED:
        return ""
    if quant.get("quant_method") != "compressed-tensors" or quant.get("format") != "pack-quantized":
        raise ModelFormatError(
            f"unsupported checkpoint quantization {quant.get('quant_method')!r} / "
            f"{quant.get('format')!r}; kvmesh loads compressed-tensors pack-quantized INT4"
        )
    return json.dumps(quant, sort_keys=True)


def _mla(cfg: dict[str, Any]) -> MlaConfig | None:
    if "kv_lora_rank" not in cfg:
        return None
    return MlaConfig(
        cfg.get("q_lora_rank"),
        cfg["kv_lora_rank"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )


def _moe(arch: str, cfg: dict[str, Any]) -> MoeConfig | None:
    layers = range(cfg["num_hidden_layers"])
    if arch == "qwen3_moe":
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        moe = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        return MoeConfig(
            _num_experts(cfg),
            cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"],
            moe,
            norm_topk_prob=cfg.get("norm_topk_prob", False),
        )
    if _num_experts(cfg) is None:
        return None
    if cfg.get("mlp_layer_types"):
        moe = tuple(i for i in layers if cfg["mlp_layer_types"][i] == "sparse")
    else:
        first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        moe = tuple(i for i in layers if i >= first and i % freq == 0)
    return MoeConfig(
        _num_experts(cfg),
        cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"],
        moe,
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        scoring="sigmoid",
        norm_topk_prob=cfg.get("norm_topk_prob", True),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        num_groups=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        correction_bias=True,
    )


def _num_experts(cfg: dict[str, Any]) -> int | None:
    """Hub configs say num_experts (Qwen) or n_routed_experts (DeepSeek, GLM); transformers 5
    writes num_local_experts."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return None


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ModelFormatError(f"unsupported rope scaling {kind!r}")
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor") or 1.0),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position=int(raw.get("original_max_position_embeddings") or 8192),
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        mscale=float(raw.get("mscale") or 0.0) if kind == "yarn" else 1.0,
        mscale_all_dim=float(raw.get("mscale_all_dim") or 0.0),
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
