"""Byte layout of one KV page, per KV dtype (pure Python: the launcher and routers use it too).

A page holds K and V of `page_size` tokens for every layer as ONE contiguous byte range, so the
transfer engine moves a page as one segment and the KV store stores it as one blob:

    data   [layer, k|v, slot, head, dim]   in the KV dtype
    scales [layer, k|v, slot, head]        fp8_e4m3 only: int8 power-of-two exponents

FP8 scale granularity: one scale per (token, head) vector of `head_dim` values. A page fills one
token at a time during decode, so a per-page scale would force re-quantizing the whole page
whenever a larger value arrives; per token-head, each write is quantized once and never touched
again, and an outlier only costs the precision of its own vector. The scale is a power of two,
stored as its exponent in one byte: x ~= q * 2**e with e = ceil(log2(amax / 448)), so |x|/2**e
uses e4m3's full range up to 448 and dequantizing is exact (a power-of-two multiply). The cost
is 1 byte per `head_dim` bytes: 65/64 of the data, so a page is 1.97x smaller than BF16's.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = ("fp32", "bf16", "fp8_e4m3")
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8_e4m3": 1}


def resolve_kv_dtype(kv_dtype: str, model_dtype: str) -> str:
    """'auto' stores KV in the model's dtype."""
    resolved = model_dtype if kv_dtype == "auto" else kv_dtype
    if resolved not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be auto or one of {KV_DTYPES}, got {kv_dtype!r}")
    return resolved


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def vectors_per_page(self) -> int:
        """(layer, k|v, slot, head) vectors of head_dim values in one page."""
        return 2 * self.num_layers * self.page_size * self.num_kv_heads

    @property
    def data_bytes(self) -> int:
        return self.vectors_per_page * self.head_dim * _ELEMENT_BYTES[self.kv_dtype]

    @property
    def scale_bytes(self) -> int:
        return self.vectors_per_page if self.quantized else 0

    @property
    def page_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    def pages_for_budget(self, budget_bytes: int) -> int:
        return max(budget_bytes // self.page_bytes, 1)


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
