"""The machine's limits that `kvmesh bench serve` puts the mesh's figures against, measured in
the same run with the mesh idle (this VM's speed swings +-20 % within an hour):

- the weight-bandwidth bound of single-stream decode: a token reads every weight once, so the
  bound is memory-read GB/s (bench kernels' ceiling: the fastest GEMV over 256 MiB) / weight bytes;
- the compute bound of aggregate decode: torch's bf16 GEMM GFLOP/s on SmolLM2's linear shapes at
  512 rows (bench kernels' `gemm_ceiling`) / the FLOPs of a token, 2 per weight element of the
  linears and the LM head (an untied input table is a gather: not counted). Dense models with
  dense weights only (an MoE token uses a fraction of its weights; INT4 is not a bf16 GEMM).
"""

from __future__ import annotations

from typing import Any

from kvmesh.benchmarks.kernels import ceiling, gemm_ceiling

ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


def measure_bounds(suite: dict[str, Any], model: str, dtype: str, weights: str,
                   before: float) -> dict[str, Any]:  # fmt: skip
    """`bandwidth` (single stream / its bound) and `compute` (each level's aggregate / the
    compute bound) of a suite; `before`: the memory-read GB/s measured before the suite."""
    from kvmesh import LLM

    after = ceiling(5)
    llm = LLM(model=model, dtype=dtype, weights=weights, num_pages=4)
    nbytes = llm.engine.runner.model.weight_bytes
    out: dict[str, Any] = {"bandwidth": None, "compute": None}
    single = suite["single_stream"]
    if single:
        bound = (before + after) / 2 * 1e9 / nbytes
        out["bandwidth"] = {"ceiling_gbs": [round(before, 2), round(after, 2)],
                            "weight_bytes": nbytes, "bound_tok_s": round(bound, 1),
                            "of_bound": round(single["decode_tok_s"] / bound, 3)}  # fmt: skip
    size = ELEMENT_BYTES.get(weights if weights != "auto" else dtype)
    net = llm.engine.runner.model
    if (
        size is not None
        and suite["levels"]
        and getattr(llm.engine.model_config, "moe", None) is None
    ):
        untied = net.embed.nbytes if net.embed is not net.lm_head else 0
        gflops = gemm_ceiling(3)
        bound = gflops * 1e9 / (2 * (nbytes - untied) / size)
        out["compute"] = {"gemm_gflops": round(gflops, 1), "bound_tok_s": round(bound, 1),
                          "of_bound": {str(r["concurrency"]): round(r["output_tok_s"] / bound, 3)
                                       for r in suite["levels"]}}  # fmt: skip
    return out
