"""Byte layout of one KV page, from the model's KV spec (pure Python: the launcher and routers
use it too).

A page holds `page_size` tokens of KV for every layer as ONE contiguous byte range, so the
transfer engine moves a page as one segment and the KV store stores it as one blob. What a layer
caches per token is its `LayerKVSpec`:

    gqa   K and V of `num_heads` KV heads of `head_dim` values       (2 parts per head)
    mla   one latent vector: kv_lora_rank + qk_rope_head_dim values  (1 part, 1 "head")

The page is ordered head-major, so one head's KV (all layers, FP8 scales included) is one
contiguous block, and a tensor-parallel rank's head slice of a page is one byte range:

    page   = [head] x head block
    block  = data of layer 0, data of layer 1, ...,  scales of layer 0, scales of layer 1, ...
    data   [slot, part, dim]   in the KV dtype (K and V of a slot side by side: one gather)
    scales [slot, part]        fp8_e4m3 only: int8 power-of-two exponents

FP8 scale granularity: one scale per (token, head, part) vector. A page fills one token at a
time during decode, so a per-page scale would force re-quantizing the whole page whenever a
larger value arrives; per vector, each write is quantized once and never touched again, and an
outlier only costs the precision of its own vector. The scale is a power of two, stored as its
exponent in one byte: x ~= q * 2**e with e = ceil(log2(amax / 448)), so |x|/2**e uses e4m3's
full range up to 448 and dequantizing is exact (a power-of-two multiply). The cost is 1 byte
per vector: 65/64 of the data for 64-dim GQA heads, 577/576 for DeepSeek-V3's MLA latent.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.engine import KV_DTYPES

# fp8_e4m3 pages: e4m3fn values, each (token, head) row scaled by 2**e (kv_fp8.py encodes them)
FP8_MAX = 448.0
EXP_MIN, EXP_MAX = -110, 110  # 2**(e + 8) must stay a normal fp32
KV_KINDS = ("gqa", "mla")
# bump when the byte order of a page, or how a worker says where its pages are, changes (pairs
# P/D workers and stores); 3: sharded destinations (KvDestination.shards), which a worker of 2
# would not read; 4: a transfer session per shard (KvShard.te_session), which 3 would not use
LAYOUT_VERSION = 4
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8_e4m3": 1}


def resolve_kv_dtype(kv_dtype: str, model_dtype: str) -> str:
    """'auto' stores KV in the model's dtype."""
    resolved = model_dtype if kv_dtype == "auto" else kv_dtype
    if resolved not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be auto or one of {KV_DTYPES}, got {kv_dtype!r}")
    return resolved


@dataclass(frozen=True)
class LayerKVSpec:
    """What one layer caches per token (see the module docstring)."""

    kind: str
    num_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"KV kind must be one of {KV_KINDS}, got {self.kind!r}")
        if self.num_heads < 1 or self.head_dim < 1 or (self.kind == "mla" and self.num_heads != 1):
            raise ValueError(f"bad {self.kind} layer: {self.num_heads} heads of {self.head_dim}")

    @property
    def parts(self) -> int:
        return 2 if self.kind == "gqa" else 1


@dataclass(frozen=True)
class KVCacheSpec:
    layers: tuple[LayerKVSpec, ...]
    page_size: int
    kv_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if not self.layers or len({layer.num_heads for layer in self.layers}) != 1:
            raise ValueError("every layer of a KV spec must cache the same number of heads")

    @classmethod
    def gqa(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        kv_dtype: str = "fp32",
    ) -> KVCacheSpec:
        return cls((LayerKVSpec("gqa", num_kv_heads, head_dim),) * num_layers, page_size, kv_dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        return self.layers[0].num_heads

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self.kv_dtype]

    def data_bytes_of(self, layer: int) -> int:
        """Bytes of one layer's data in one head block."""
        spec = self.layers[layer]
        return spec.parts * self.page_size * spec.head_dim * self.element_bytes

    def scale_bytes_of(self, layer: int) -> int:
        return self.layers[layer].parts * self.page_size if self.quantized else 0

    def data_offset(self, layer: int) -> int:
        """Where a layer's data starts inside a head block."""
        return sum(self.data_bytes_of(i) for i in range(layer))

    def scale_offset(self, layer: int) -> int:
        data = self.data_offset(self.num_layers)
        return data + sum(self.scale_bytes_of(i) for i in range(layer))

    @property
    def head_block_bytes(self) -> int:
        return self.scale_offset(self.num_layers)

    @property
    def page_bytes(self) -> int:
        return self.num_heads * self.head_block_bytes

    def bytes_per_token(self, layer: int = 0) -> int:
        """KV bytes one token costs in one layer (scales included)."""
        return (
            self.num_heads
            * (self.data_bytes_of(layer) + self.scale_bytes_of(layer))
            // (self.page_size)
        )

    @property
    def layout_key(self) -> str:
        """Names the page format: workers and stores exchange pages only under equal keys."""
        kinds = sorted({f"{s.kind}{s.num_heads}x{s.head_dim}" for s in self.layers})
        return f"v{LAYOUT_VERSION}:{self.num_layers}L:{'+'.join(kinds)}:p{self.page_size}:{self.kv_dtype}"

    def pages_for_budget(self, budget_bytes: int) -> int:
        """Pages a pool of `budget_bytes` holds; two pages of it are the pool's null and scratch
        pages (kv_cache.py)."""
        return max(budget_bytes // self.page_bytes - 2, 1)
