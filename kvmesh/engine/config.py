"""A model's architecture as the engine reads it (HF config names where they exist); the
user's knobs are the config tree's (kvmesh/config/)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvmesh.engine.kv.layout import KVCacheSpec, LayerKVSpec
from kvmesh.errors import ModelFormatError


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling`); kind is default, linear, llama3 or yarn
    (beta_fast / beta_slow / mscale / mscale_all_dim are yarn's)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash / GLM 5): K and V
    come from one `kv_lora_rank` latent per token plus a shared `qk_rope_head_dim` rotary key."""

    q_lora_rank: int | None  # None: q is a plain projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


ROUTER_SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: `num_experts` routed experts of `intermediate_size`, top
    `top_k` per token, plus `num_shared_experts` always-on experts. sigmoid scoring (DeepSeek-V3,
    GLM) picks with a correction bias inside the best `topk_group` of `num_groups` groups;
    `layers` are the MoE layers (the others keep the dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # 0: num_shared_experts * intermediate_size
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_group: int = 1
    correction_bias: bool = False  # e_score_correction_bias steers the choice only
    expert_shard: tuple[int, int] = (0, 1)  # (rank, ranks): experts held under expert parallelism

    @property
    def held_experts(self) -> range:
        """The routed experts this process holds (all but under expert parallelism)."""
        rank, ranks = self.expert_shard
        return range(self.num_experts * rank // ranks, self.num_experts * (rank + 1) // ranks)

    def __post_init__(self) -> None:
        if self.scoring not in ROUTER_SCORING:
            raise ModelFormatError(f"router scoring {self.scoring!r} not in {ROUTER_SCORING}")
        if not 0 < self.top_k <= self.num_experts or self.num_experts % self.num_groups:
            raise ModelFormatError(
                f"MoE with {self.num_experts} experts, top {self.top_k}, "
                f"{self.num_groups} groups is inconsistent"
            )


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer (GLM 5): each query attends to its
    `topk` best-scored keys; this engine runs it only while every key is kept (dense MLA)."""

    topk: int


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (HF names where they exist). `architecture` is the family
    (llama, qwen3, deepseek_v3, ...; see models/registry.py); attention is GQA unless `mla`;
    the MLP is dense unless `moe` lists the layer."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # RMSNorm of each q and k head before rotary (Qwen3, GLM)
    rotary_dim: int = 0  # rotated dims of each head (partial rotary); 0: all of head_dim
    rope_interleave: bool = False  # rotary pairs (0,1),(2,3).. instead of halves (DeepSeek)
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    indexer: IndexerConfig | None = None
    # tokens a query attends back (Mistral v0.1's `sliding_window`); None: the whole context.
    # Not implemented: the engine caps its context at the window, where it is exact.
    sliding_window: int | None = None
    # config.json's `quantization_config` as JSON when the checkpoint ships pack-quantized
    # INT4 (compressed-tensors, e.g. Kimi K2's routed experts); "" otherwise
    quantization_config: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if min(self.vocab_size, self.hidden_size, self.num_layers, self.head_dim) <= 0:
            raise ModelFormatError("model config has a non-positive dimension")

    @property
    def rope_dim(self) -> int:
        """Dims of a head that rotary rotates."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Inverse of `dataclasses.asdict` (the converted-model cache stores configs as JSON)."""
        raw = dict(raw)
        raw["rope_scaling"] = RopeScaling(**raw.get("rope_scaling") or {})
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
        for name, kind in (("mla", MlaConfig), ("moe", MoeConfig), ("indexer", IndexerConfig)):
            if raw.get(name) is not None:
                raw[name] = kind(**raw[name])
        if raw.get("moe") is not None:
            raw["moe"] = replace(raw["moe"], layers=tuple(raw["moe"].layers))
        return cls(**raw)


def spec_for_model(config: ModelConfig, page_size: int, kv_dtype: str) -> KVCacheSpec:
    """The KV spec a model needs: MLA latent pages or GQA pages."""
    if config.mla is not None:
        layer = LayerKVSpec("mla", 1, config.mla.cache_dim)
    else:
        layer = LayerKVSpec("gqa", config.num_kv_heads, config.head_dim)
    return KVCacheSpec((layer,) * config.num_layers, page_size, kv_dtype)
