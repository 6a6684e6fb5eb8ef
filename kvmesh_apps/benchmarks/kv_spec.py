"""The KV spec table of `kvmesh bench kv`: what a model's pages hold, in each KV dtype, and how
many tokens fit in one memory budget (pure arithmetic on the spec, no model loaded)."""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = ("fp32", "bf16", "fp8_e4m3")


@dataclass(frozen=True)
class SpecRow:
    kv_dtype: str
    kind: str  # gqa | mla
    heads: int
    values_per_token: int  # per layer: K and V of every KV head, or the MLA latent + rope key
    bytes_per_token_layer: int  # FP8 scales included
    page_bytes: int
    capacity_tokens: int  # at the budget
    vs_bf16: float


def spec_rows(model: str, page_size: int, budget: int) -> list[SpecRow]:
    from kvmesh.engine.config import spec_for_model
    from kvmesh.engine.loader import read_config, resolve_model

    config = read_config(resolve_model(model))
    specs = {d: spec_for_model(config, page_size, d) for d in KV_DTYPES}
    capacity = {d: s.pages_for_budget(budget) * page_size for d, s in specs.items()}
    rows = []
    for dtype, spec in specs.items():
        layer = spec.layers[0]
        rows.append(
            SpecRow(
                dtype,
                layer.kind,
                layer.num_heads,
                layer.parts * layer.num_heads * layer.head_dim,
                spec.bytes_per_token(),
                spec.page_bytes,
                capacity[dtype],
                round(capacity[dtype] / capacity["bf16"], 3),
            )
        )
    return rows


def spec_markdown(model: str, rows: list[SpecRow], budget: int) -> str:
    lines = [
        f"\nKV spec of {model}: per token and layer, and tokens that fit in {budget:,} bytes\n",
        "| KV | kind | heads | values/token/layer | bytes/token/layer | page bytes | "
        "capacity tokens | vs BF16 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kv_dtype} | {r.kind} | {r.heads} | {r.values_per_token} | "
            f"{r.bytes_per_token_layer} | {r.page_bytes:,} | {r.capacity_tokens:,} | "
            f"{r.vs_bf16} |"
        )
    return "\n".join(lines)
