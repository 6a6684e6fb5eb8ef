"""The engine's config tree: what to load, the KV cache, batching, speculation, parallelism and
the device. Each knob is declared here once; `kvmesh generate`, `serve prefill|decode` and `up`
get their flags from these declarations (flags.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.device import DeviceConfig
from kvmesh.config.knobs import Alias, build, check, knob, section
from kvmesh.errors import InvalidRequestError

DEFAULT_MODEL = "smollm2-135m"
DTYPES = ("fp32", "bf16")
WEIGHTS = ("auto", "fp32", "bf16", "int4")
KV_DTYPES = ("fp32", "bf16", "fp8_e4m3")
INT4_GROUPS = (0, 32, 64, 128)
SPECULATIVE = ("none", "ngram", "eagle")
SPEC_POLICIES = ("adaptive", "fixed")  # spec/policy.py


def parse_size(text: str) -> int:
    """'256MiB', '2GiB', '512M', '1.5G', '1048576' -> bytes (binary units; B optional)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 256MiB, 2GiB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value * units[unit])


def _int4_group(text: str) -> int:
    if text in ("auto", "0"):
        return 0
    if text not in ("32", "64", "128"):
        raise ValueError(f"expected auto, 32, 64 or 128, got {text!r}")
    return int(text)


@dataclass(frozen=True)
class LoadConfig:
    """What is loaded, and in which precision."""

    model: str = knob(DEFAULT_MODEL, "alias, .gguf file or HF safetensors folder")
    dtype: str = knob(
        "auto",
        "activations and dense weights (auto: bf16 with --weights int4, else fp32)",
        choices=("auto", *DTYPES),
    )
    weights: str = knob(
        "auto",
        "weight precision (auto: --dtype; int4: group-wise INT4, "
        "activations in --dtype; decode with --dtype fp32 is several times "
        "slower than with bf16)",
        choices=WEIGHTS,
    )
    int4_group_size: int = knob(
        0,
        "INT4 group size (auto: a GGUF's own Q4 blocks as they are, "
        "else 32; regrouping GGUF blocks requantizes them)",
        choices=INT4_GROUPS,
        parse=_int4_group,
        metavar="auto|32|64|128",
    )
    int4_embeddings: bool = knob(
        False,
        "INT4 token embedding and LM head too (default off: they keep --dtype)",
        style="on_off",
    )
    max_model_len: int | None = knob(
        None, "context length (default: the model's)", parse=int, bounds=(2, None)
    )
    seed: int = knob(0, "the engine's random seed (sampling without a per-request seed)")

    def __post_init__(self) -> None:
        check(self)

    @property
    def compute_dtype(self) -> str:
        return compute_dtype_of(self.dtype, self.weights)


def compute_dtype_of(dtype: str, weights: str) -> str:
    """Activations (and dense weights): --weights fp32/bf16 set it, else --dtype, whose "auto"
    is bf16 under INT4 weights (the CPU int4 kernel's fp32 path is slow) and fp32 otherwise."""
    if weights in DTYPES:
        return weights
    if dtype == "auto":
        return "bf16" if weights == "int4" else "fp32"
    return dtype


@dataclass(frozen=True)
class CacheConfig:
    """The KV page pool: page size, storage format, budget, and the pages' integrity check."""

    page_size: int = knob(16, "tokens per KV page (a power of two)", bounds=(1, 4096))
    kv_dtype: str = knob(
        "auto",
        "KV page storage (auto: the model dtype; fp8_e4m3: half of BF16's bytes)",
        choices=("auto", *KV_DTYPES),
    )
    kv_cache_bytes: int = knob(
        512 << 20,
        "KV page pool budget, e.g. 256MiB or 2GiB (default 512MiB)",
        flag="--kv-cache-memory",
        parse=parse_size,
        metavar="SIZE",
        aliases=(Alias("--kv-cache-mib", lambda mib: int(mib) << 20, "the same budget in MiB"),),
    )
    num_pages: int | None = knob(
        None, "KV pages (default: as many as --kv-cache-memory holds)", parse=int, bounds=(1, None)
    )
    kv_hugepages: bool = knob(
        False,
        "the KV page pool on 2 MiB hugepages (reserved beforehand: "
        "sysctl vm.nr_hugepages, a pod's hugepages-2Mi); fewer pages for an "
        "RDMA NIC to map",
        style="on_off",
    )
    kv_integrity: bool = knob(
        True, "check every KV page's integrity tag before each step", style="on_off"
    )
    kv_integrity_action: str = knob(
        "recompute",
        "a request holding a page that fails its tag: "
        "recompute its KV from its tokens and go on (the output "
        "equals a fault-free run), or abort it with a kv_integrity "
        "error",
        choices=("recompute", "abort"),
    )
    enable_prefix_caching: bool = knob(
        True, "reuse cached pages of a shared prompt prefix", style="on_off"
    )

    def __post_init__(self) -> None:
        check(self)
        if self.page_size & (self.page_size - 1):
            raise InvalidRequestError(f"page_size must be a power of two, got {self.page_size}")

    def resolved_kv_dtype(self, compute_dtype: str) -> str:
        return compute_dtype if self.kv_dtype == "auto" else self.kv_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of a step."""

    max_num_seqs: int = knob(64, "sequences in a step at most", bounds=(1, None))
    max_num_batched_tokens: int = knob(
        1024, "tokens in a step at most (prefill chunks)", bounds=(1, None)
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative: str = knob(
        "none",
        "speculative decoding: n-gram prompt lookup or the EAGLE draft head",
        choices=SPECULATIVE,
    )
    num_speculative_tokens: int = knob(
        4, "drafts per step (at most, when adaptive)", bounds=(1, 16)
    )
    speculative_policy: str = knob(
        "adaptive",
        "draft lengths per step from measured acceptance "
        "and step costs, or always --num-speculative-tokens",
        choices=SPEC_POLICIES,
    )
    draft_model: str = knob("", "EAGLE head file (default: the shipped one)")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = knob(
        1,
        "rank processes the model's layers are split over "
        "(their sums through shared memory on one host)",
        bounds=(1, 8),
    )
    pipeline_parallel_size: int = knob(
        1, "stages of contiguous layers, each of --tensor-parallel-size ranks", bounds=(1, 8)
    )
    enable_expert_parallel: bool = knob(
        False,
        "MoE: each rank holds whole experts (a share of them) instead of a slice of every expert",
        style="switch",
    )
    # 1 by default: on a machine of few cores the groups' extra passes cost more than their
    # overlap gives (docs/benchmarks.md, "Tensor, expert and pipeline parallelism")
    pipeline_micro_batches: int = knob(
        1,
        "a step's rows through the pipeline stages in this many groups (0: one per stage)",
        bounds=(0, 64),
    )

    def __post_init__(self) -> None:
        check(self)
        if self.world_size > 16:
            raise InvalidRequestError("at most 16 ranks (tensor x pipeline parallel size)")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise InvalidRequestError("expert parallelism needs tensor_parallel_size >= 2")

    @property
    def world_size(self) -> int:
        """Rank processes of one engine: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def micro_batches(self) -> int:
        """Groups a step's rows run in through the pipeline stages (1 without stages)."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size


@dataclass(frozen=True)
class Int4Scheme:
    """How `--weights int4` stores weights. group 0: a source's own INT4 blocks as they are (GGUF
    Q4_0/Q4_1: 32), float weights in groups of 32; 32/64/128: everything in groups of that size
    (regrouping GGUF blocks is a lossy requantization). embeddings: the token embedding and the
    LM head in INT4 too (else they stay in the compute dtype)."""

    group: int = 0
    embeddings: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs beyond the model's own config."""

    load: LoadConfig = section(LoadConfig)
    cache: CacheConfig = section(CacheConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    spec: SpeculativeConfig = section(SpeculativeConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    device: DeviceConfig = section(DeviceConfig)

    @classmethod
    def of(cls, **knobs: object) -> EngineConfig:
        """By knob names: `EngineConfig.of(model="m", kv_dtype="fp8_e4m3")`."""
        return build(cls, **knobs)

    def __post_init__(self) -> None:
        if self.parallel.world_size > 1 and self.spec.speculative != "none":
            raise InvalidRequestError(
                "speculative decoding with tensor or pipeline parallelism is not supported yet"
            )
        if self.parallel.world_size > 1 and self.load.int4_embeddings:
            raise InvalidRequestError(
                "INT4 embeddings with tensor or pipeline parallelism are not supported yet"
            )

    @property
    def compute_dtype(self) -> str:
        return self.load.compute_dtype

    @property
    def resolved_kv_dtype(self) -> str:
        """The KV pages' storage, "auto" resolved."""
        return self.cache.resolved_kv_dtype(self.compute_dtype)

    @property
    def int4(self) -> Int4Scheme | None:
        if self.load.weights != "int4":
            return None
        return Int4Scheme(self.load.int4_group_size, self.load.int4_embeddings)
