"""The precision `kvmesh up` serves in when no flag names one: the fastest that is exact enough
for serving on the CPU it runs on. bf16 everywhere (a perplexity close to fp32's, and a faster
decode); on a CPU without a bf16 dot product (AVX2, AVX-512 without AVX512_BF16 / AMX) a model
whose matrices are already 4-bit (a Q4_0 / Q4_1 GGUF, as the default SmolLM2 is) runs on INT4
weights that hold those values exactly, with bf16 activations: faster there than bf16, where a
bf16 CPU runs both alike. fp32 stays one flag away (`--dtype fp32`): exactness checks, tests.
Figures: docs/benchmarks.md, "Serving defaults"."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvmesh.engine.kernels.build import cpu_flags
from kvmesh.engine.loader.gguf_header import read_header
from kvmesh.engine.loader.resolve import resolve_model

FOUR_BIT = ("Q4_0", "Q4_1")  # what INT4 weights hold exactly (engine/loader/gguf_loader.py)


@dataclass(frozen=True)
class Precision:
    dtype: str  # --dtype
    weights: str  # --weights
    why: str  # for the banner


BF16_DOT = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of a CPU with a bf16 dot product


def serving_precision(model: str, cpu: set[str] | None = None) -> Precision:
    """What `kvmesh up --model MODEL` serves in by default on a CPU with these `cpu` flags
    (None: this one's)."""
    flags = cpu_flags() if cpu is None else cpu
    source = resolve_model(model)
    if source.gguf_file is not None and not flags & set(BF16_DOT):
        kinds = Counter(t.qtype for t in read_header(source.gguf_file).tensors if len(t.shape) == 2)
        four_bit = sum(kinds[q] for q in FOUR_BIT)
        if four_bit and four_bit >= sum(kinds.values()) // 2:
            held = "/".join(q for q in FOUR_BIT if kinds[q])
            return Precision(
                "bf16",
                "int4",
                f"INT4 weights holding the GGUF's {held} values, "
                "bf16 activations (this CPU has no bf16 dot product)",
            )
    return Precision("bf16", "auto", "bf16 weights and activations")
