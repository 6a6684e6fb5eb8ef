"""The precision `kvmesh up` serves in when no flag names one: the fastest that is exact enough
for serving (docs/benchmarks.md, "Serving defaults"). A model whose matrices are already 4-bit
(a Q4_0 / Q4_1 GGUF, as the default SmolLM2 is) runs on INT4 weights that hold those values
exactly, with bf16 activations; any other model runs in bf16. fp32 stays one flag away
(`--dtype fp32`), for exactness checks and the tests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvmesh.engine.loader.gguf_header import read_header
from kvmesh.engine.loader.resolve import resolve_model

FOUR_BIT = ("Q4_0", "Q4_1")  # what INT4 weights hold exactly (engine/loader/gguf_loader.py)


@dataclass(frozen=True)
class Precision:
    dtype: str  # --dtype
    weights: str  # --weights
    why: str  # for the banner


def serving_precision(model: str) -> Precision:
    """What `kvmesh up --model MODEL` serves in by default."""
    source = resolve_model(model)
    if source.gguf_file is not None:
        kinds = Counter(t.qtype for t in read_header(source.gguf_file).tensors if len(t.shape) == 2)
        four_bit = sum(kinds[q] for q in FOUR_BIT)
        if four_bit and four_bit >= sum(kinds.values()) // 2:
            held = "/".join(q for q in FOUR_BIT if kinds[q])
            return Precision("bf16", "int4", f"INT4 weights holding the GGUF's {held} values, "
                             "bf16 activations")  # fmt: skip
    return Precision("bf16", "auto", "bf16 weights and activations")
