"""The machine's limits that `kvmesh bench serve` puts the mesh's figures against, measured in
the same run with the mesh idle (this VM's speed swings +-20 % within an hour):

- the weight-bandwidth bound of single-stream decode: a token reads every weight once, so the
  bound is memory-read GB/s (bench kernels' ceiling: the fastest GEMV over 256 MiB) / weight bytes,
  the ceiling measured before and after each single-stream request (it moves by a third within
  a minute here): each request against the mean of the two beside it, the median over requests;
- the compute bound of aggregate decode: torch's bf16 GEMM GFLOP/s on SmolLM2's linear shapes at
  512 rows (bench kernels' `gemm_ceiling`) / the FLOPs of a token, 2 per weight element of the
  linears and the LM head (an untied input table is a gather: not counted). Dense models with
  dense weights only (an MoE token uses a fraction of its weights; INT4 is not a bf16 GEMM).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvmesh_apps.benchmarks.kernels import gemm_ceiling

ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


def measure_bounds(
    suite: dict[str, Any],
    model: str,
    dtype: str,
    weights: str,
    gemm_gflops: Callable[[], float] = lambda: gemm_ceiling(3),
) -> dict[str, Any]:
    """`bandwidth` (single stream / its bound) and `compute` (each level's aggregate / the
    compute bound) of a suite whose single stream was measured with a ceiling probe;
    `gemm_gflops` measures the GEMM ceiling (a test passes a fixed figure)."""
    from kvmesh import LLM

    llm = LLM(model=model, dtype=dtype, weights=weights, num_pages=4)
    nbytes = llm.engine.runner.model.weight_bytes
    out: dict[str, Any] = {"bandwidth": None, "compute": None}
    single = suite["single_stream"]
    if single and single.get("ceilings_gbs"):
        gbs, rates = single["ceilings_gbs"], single["request_tok_s"]
        bounds = [(gbs[i] + gbs[i + 1]) / 2 * 1e9 / nbytes for i in range(len(rates))]
        ratios = [rate / bound for rate, bound in zip(rates, bounds, strict=True) if rate]
        out["bandwidth"] = {
            "ceiling_gbs": gbs,
            "weight_bytes": nbytes,
            "bound_tok_s": round(float(np.median(bounds)), 1),
            "of_bound_per_request": [round(r, 3) for r in ratios],
            "of_bound": round(float(np.median(ratios)), 3) if ratios else None,
        }
    size = ELEMENT_BYTES.get(weights if weights != "auto" else dtype)
    net = llm.engine.runner.model
    if (
        size is not None
        and suite["levels"]
        and getattr(llm.engine.model_config, "moe", None) is None
    ):
        untied = net.embed.nbytes if net.embed is not net.lm_head else 0
        gflops = gemm_gflops()
        bound = gflops * 1e9 / (2 * (nbytes - untied) / size)
        out["compute"] = {
            "gemm_gflops": round(gflops, 1),
            "bound_tok_s": round(bound, 1),
            "of_bound": {
                str(r["concurrency"]): round(r["output_tok_s"] / bound, 3) for r in suite["levels"]
            },
        }
    return out
