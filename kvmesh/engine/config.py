"""Frozen, validated configs of the engine's components."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvmesh.engine.kv.layout import KV_DTYPES, KVCacheSpec, LayerKVSpec
from kvmesh.errors import InvalidRequestError, ModelFormatError

DTYPES = ("fp32", "bf16")
WEIGHTS = ("auto", "fp32", "bf16", "int4")
SPECULATIVE = ("none", "ngram", "eagle")
SPEC_POLICIES = ("adaptive", "fixed")  # spec/policy.py
DECODE_STEPS = ("fused", "eager", "compiled")  # fused_decode.py, compiled.py


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


def compute_dtype_of(dtype: str, weights: str) -> str:
    """Activations (and dense weights): --weights fp32/bf16 set it, else --dtype, whose "auto"
    is bf16 under INT4 weights (the CPU int4 kernel's fp32 path is slow) and fp32 otherwise."""
    if weights in DTYPES:
        return weights
    if dtype == "auto":
        return "bf16" if weights == "int4" else "fp32"
    return dtype


@dataclass(frozen=True)
class Int4Scheme:
    """How `--weights int4` stores weights. group 0: a source's own INT4 blocks as they are (GGUF
    Q4_0/Q4_1: 32), float weights in groups of 32; 32/64/128: everything in groups of that size
    (regrouping GGUF blocks is a lossy requantization). embeddings: the token embedding and the
    LM head in INT4 too (else they stay in the compute dtype)."""

    group: int = 0
    embeddings: bool = False


INT4_GROUPS = (0, 32, 64, 128)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs beyond the model: dtype, KV pool and batching limits."""

    model: str
    dtype: str = "auto"  # fp32, bf16, or auto: see compute_dtype_of
    page_size: int = 16
    num_pages: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    decode_step: str = "fused"  # fused (one C++ op where the model fits: fused_decode.py),
    # eager, or compiled (torch.compile of decode steps: compiled.py)
    attention_backend: str = "auto"  # auto, torch or cpu (attention/__init__.py)
    seed: int = 0
    kv_dtype: str = "auto"  # auto (= dtype), fp32, bf16 or fp8_e4m3
    weights: str = "auto"  # auto (= dtype), fp32, bf16 (also the compute dtype) or int4
    int4_group_size: int = 0  # with weights=int4: see Int4Scheme
    int4_embeddings: bool = False
    kv_hugepages: bool = False  # the page pool on 2 MiB hugepages (reserved by the operator)
    kv_integrity: bool = True  # check every page's tag before each step
    # a request holding a page that fails its tag: its KV is recomputed from its tokens (the
    # page discarded) and it goes on, or it is aborted with a kv_integrity error
    kv_integrity_action: str = "recompute"  # recompute | abort
    speculative: str = "none"  # none, ngram or eagle
    num_speculative_tokens: int = 4  # drafts verified per step (at most, when adaptive)
    speculative_policy: str = "adaptive"  # adaptive (lengths from measurements) or fixed
    draft_model: str | None = None  # EAGLE head (safetensors); None: the shipped default
    tensor_parallel_size: int = 1  # rank processes one model's layers are split over (parallel/)
    enable_expert_parallel: bool = False  # MoE: experts partitioned over those ranks, not split
    pipeline_parallel_size: int = 1  # stages of contiguous layers, each its TP ranks
    # a step's rows through the stages in this many groups (0: one per stage); 1 by default:
    # on 2 cores the groups' extra passes cost more than their overlap gives (benchmarks.md)
    pipeline_micro_batches: int = 1

    @property
    def compute_dtype(self) -> str:
        return compute_dtype_of(self.dtype, self.weights)

    @property
    def int4(self) -> Int4Scheme | None:
        if self.weights != "int4":
            return None
        return Int4Scheme(self.int4_group_size, self.int4_embeddings)

    @property
    def resolved_kv_dtype(self) -> str:
        return self.compute_dtype if self.kv_dtype == "auto" else self.kv_dtype

    @property
    def micro_batches(self) -> int:
        """Groups a step's rows run in through the pipeline stages (1 without stages)."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Rank processes of one engine: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.kv_integrity_action not in ("recompute", "abort"):
            raise InvalidRequestError(
                f"kv_integrity_action must be recompute or abort, got {self.kv_integrity_action!r}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(
                f"kv_dtype must be auto or one of {KV_DTYPES}, got {self.kv_dtype!r}"
            )
        if self.weights not in WEIGHTS:
            raise InvalidRequestError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.int4_group_size not in INT4_GROUPS:
            raise InvalidRequestError(
                f"int4_group_size must be one of {INT4_GROUPS} (0: the source's), "
                f"got {self.int4_group_size!r}"
            )
        if self.speculative not in SPECULATIVE:
            raise InvalidRequestError(
                f"speculative must be one of {SPECULATIVE}, got {self.speculative!r}"
            )
        if self.decode_step not in DECODE_STEPS:
            raise InvalidRequestError(
                f"decode_step must be one of {DECODE_STEPS}, got {self.decode_step!r}"
            )
        if self.speculative_policy not in SPEC_POLICIES:
            raise InvalidRequestError(
                f"speculative_policy must be one of {SPEC_POLICIES}, got {self.speculative_policy!r}"
            )
        if not 1 <= self.tensor_parallel_size <= 8 or not 1 <= self.pipeline_parallel_size <= 8:
            raise InvalidRequestError("tensor_parallel_size and pipeline_parallel_size: 1..8")
        if not 0 <= self.pipeline_micro_batches <= 64:
            raise InvalidRequestError("pipeline_micro_batches must be in 0..64")
        if self.world_size > 16:
            raise InvalidRequestError("at most 16 ranks (tensor x pipeline parallel size)")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise InvalidRequestError("expert parallelism needs tensor_parallel_size >= 2")
        if self.world_size > 1 and self.speculative != "none":
            raise InvalidRequestError(
                "speculative decoding with tensor or pipeline parallelism is not supported yet"
            )
        if self.world_size > 1 and self.int4_embeddings:
            raise InvalidRequestError(
                "INT4 embeddings with tensor or pipeline parallelism are not supported yet"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError("num_speculative_tokens must be in 1..16")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise InvalidRequestError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise InvalidRequestError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_seqs and max_num_batched_tokens must be >= 1")
