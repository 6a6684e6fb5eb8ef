"""What `kvmesh make-tiny-model` builds: one frozen spec, and per architecture the keyword
arguments of transformers' own config class (pure Python: no torch, no transformers).

Every architecture keeps the features an inference implementation must get right (GQA, q/k
norms, head_dim * heads != hidden, MLA with q_lora_rank, yarn with mscale, interleaved rope,
partial rotary, sigmoid routing with a correction bias and routed_scaling_factor != 1, shared
experts, dense first layers, the DSA indexer) at sizes that run in milliseconds on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.errors import InvalidRequestError

QUANTIZE = ("none", "int4-experts")
DTYPES = ("fp32", "bf16")
MOE_ARCHS = ("qwen3_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
INT4_GROUP = 32  # compressed-tensors group size, as Kimi K2 Thinking ships


@dataclass(frozen=True)
class TinySize:
    """Model dimensions; the defaults give checkpoints of a few hundred KB."""

    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLPs
    moe_intermediate_size: int = 32  # each routed (and shared) expert
    num_layers: int | None = None  # None: the architecture's default (2 or 3)
    num_heads: int = 4
    num_experts: int = 8
    experts_per_token: int = 2

    def __post_init__(self) -> None:
        sizes = (
            self.hidden_size,
            self.intermediate_size,
            self.moe_intermediate_size,
            self.num_heads,
            self.num_experts,
            self.experts_per_token,
        )
        if min(sizes) < 1 or (self.num_layers is not None and self.num_layers < 1):
            raise InvalidRequestError(f"model sizes must be positive: {self}")
        if self.hidden_size % self.num_heads or self.num_heads % 2:
            raise InvalidRequestError(
                f"--hidden-size {self.hidden_size} must split into an even number of heads "
                f"({self.num_heads})"
            )
        if self.experts_per_token > self.num_experts:
            raise InvalidRequestError("more experts per token than experts")


@dataclass(frozen=True)
class TinySpec:
    """One tiny checkpoint: architecture, seed and everything that shapes its bytes."""

    arch: str
    seed: int = 0
    size: TinySize = field(default_factory=TinySize)
    quantize: str = "none"
    dtype: str = "fp32"
    qk_norm: bool = True  # glm4_moe's use_qk_norm
    index_topk: int = 16  # glm_moe_dsa: keys each query attends to (see GLM_DSA below)
    max_position_embeddings: int = 1024  # the context (agents' prompts need 32k-64k)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise InvalidRequestError(f"unknown --arch {self.arch!r}; one of {sorted(ARCHS)}")
        if self.quantize not in QUANTIZE or self.dtype not in DTYPES:
            raise InvalidRequestError(f"bad --quantize {self.quantize!r} or --dtype {self.dtype!r}")
        if self.quantize == "int4-experts":
            self._check_int4()
        if self.index_topk < 1:
            raise InvalidRequestError("--index-topk must be positive")
        if self.max_position_embeddings < KIMI_K2_YARN["original_max_position_embeddings"]:
            raise InvalidRequestError("--max-position-embeddings must be at least 256")

    def _check_int4(self) -> None:
        if self.arch not in MOE_ARCHS:
            raise InvalidRequestError(f"--quantize int4-experts needs an MoE arch, not {self.arch}")
        if self.size.hidden_size % INT4_GROUP or self.size.moe_intermediate_size % INT4_GROUP:
            raise InvalidRequestError(
                f"int4 experts need hidden and MoE intermediate sizes in multiples of {INT4_GROUP}"
            )

    @property
    def num_layers(self) -> int:
        default = 2 if self.arch in ("llama", "qwen3", "qwen3_moe") else 3
        return self.size.num_layers or default


@dataclass(frozen=True)
class TokenIds:
    """The tokenizer's vocabulary size and special ids, copied into config.json."""

    vocab_size: int
    bos: int  # <|endoftext|> (the tokenizer adds no BOS; it is the config's bos_token_id)
    eos: int  # <|im_end|>
    pad: int  # <|endoftext|>


def hf_config_kwargs(spec: TinySpec, ids: TokenIds) -> tuple[str, dict[str, Any]]:
    """(model_type, keyword arguments of its transformers config class)."""
    model_type, extra = ARCHS[spec.arch]
    return model_type, {**_common(spec, ids), **extra(spec)}


def _common(spec: TinySpec, ids: TokenIds) -> dict[str, Any]:
    s = spec.size
    return {
        "vocab_size": ids.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_heads // 2,  # GQA (MLA archs override: one per head)
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def _moe(spec: TinySpec) -> dict[str, Any]:
    s = spec.size
    return {
        "moe_intermediate_size": s.moe_intermediate_size,
        "num_experts_per_tok": s.experts_per_token,
        "norm_topk_prob": True,
    }


def _routed(spec: TinySpec, scaling: float) -> dict[str, Any]:
    """DeepSeek-style routing: sigmoid scores + e_score_correction_bias for the choice, one
    group, one shared expert, layer 0 dense."""
    return {
        **_moe(spec),
        "n_routed_experts": spec.size.num_experts,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": scaling,
    }


def _mla(spec: TinySpec, v_head_dim: int) -> dict[str, Any]:
    """kv_lora_rank + rope (80) != qk_nope + rope (48): the softmax scale must be the latter."""
    return {
        "num_key_value_heads": spec.size.num_heads,
        "q_lora_rank": 32,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": v_head_dim,
    }


def _dense_first(spec: TinySpec) -> list[str]:
    return ["dense"] + ["sparse"] * (spec.num_layers - 1)


def _llama(spec: TinySpec) -> dict[str, Any]:
    return {"head_dim": spec.size.hidden_size // spec.size.num_heads}


def _qwen3(spec: TinySpec) -> dict[str, Any]:
    return {"head_dim": 32}  # heads * head_dim != hidden_size, as in Qwen3-0.6B


def _qwen3_moe(spec: TinySpec) -> dict[str, Any]:
    return {
        **_qwen3(spec),
        **_moe(spec),
        "num_experts": spec.size.num_experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    }


KIMI_K2_YARN = {  # Kimi K2's rope_scaling (beta 1/1, mscale 1/1) on a 256-token original context
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,  # x factor = max_position_embeddings
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _kimi_yarn(spec: TinySpec) -> dict[str, Any]:
    """Kimi K2's yarn stretched to the checkpoint's context (Kimi: 4k x 32 = 128k)."""
    factor = spec.max_position_embeddings / KIMI_K2_YARN["original_max_position_embeddings"]
    return {**KIMI_K2_YARN, "factor": factor}


def _deepseek_v3(spec: TinySpec) -> dict[str, Any]:
    """Kimi K2's shape: noaux_tc sigmoid routing scaled by 2.827, yarn, interleaved rope."""
    return {
        **_routed(spec, 2.827),
        **_mla(spec, 32),
        "first_k_dense_replace": 1,
        "rope_parameters": _kimi_yarn(spec),
        "rope_interleave": True,
        "num_mtp_layers": 0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }


def _glm4_moe(spec: TinySpec) -> dict[str, Any]:
    """GLM-4.5/4.6: half the head dims rotated, q/k/v biases, optional q/k norms."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return {
        **_routed(spec, 2.5),
        "head_dim": 32,
        "attention_bias": True,
        "first_k_dense_replace": 1,
        "use_qk_norm": spec.qk_norm,
        "rope_parameters": rope,
        "num_mtp_layers": 0,
    }


def _glm4_moe_lite(spec: TinySpec) -> dict[str, Any]:
    """GLM-4.7-Flash: DeepSeek MLA (v_head_dim != qk_nope_head_dim) with GLM routing."""
    return {
        **_routed(spec, 1.8),
        **_mla(spec, 48),
        "mlp_layer_types": _dense_first(spec),
        "rope_interleave": True,
    }


GLM_DSA = {"index_head_dim": 32, "index_n_heads": 16}
"""glm_moe_dsa's indexer: 16 heads so that its ReLU scores rarely tie at zero. index_topk
(TinySpec, default 16) is how many keys each query keeps; prompts longer than it exercise the
sparse selection (shorter ones attend to every key, as dense attention)."""


def _glm_moe_dsa(spec: TinySpec) -> dict[str, Any]:
    return {
        **_routed(spec, 2.5),
        **_mla(spec, 48),
        **GLM_DSA,
        "index_topk": spec.index_topk,
        "first_k_dense_replace": 1,
        "mlp_layer_types": _dense_first(spec),
    }


ARCHS: dict[str, tuple[str, Callable[[TinySpec], dict[str, Any]]]] = {
    "llama": ("llama", _llama),
    "qwen3": ("qwen3", _qwen3),
    "qwen3_moe": ("qwen3_moe", _qwen3_moe),
    "deepseek_v3": ("deepseek_v3", _deepseek_v3),
    "glm4_moe": ("glm4_moe", _glm4_moe),
    "glm4_moe_lite": ("glm4_moe_lite", _glm4_moe_lite),
    "glm_moe_dsa": ("glm_moe_dsa", _glm_moe_dsa),
}
