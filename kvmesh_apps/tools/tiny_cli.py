"""`kvmesh make-tiny-model`'s flags and its run (the flags import no torch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmesh_apps.tools.tiny_configs import ARCHS, DTYPES, QUANTIZE, TinySize, TinySpec

SIZE_FLAGS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_heads",
    "num_experts",
    "experts_per_token",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    size = TinySize()
    p.add_argument("--arch", required=True, choices=sorted(ARCHS))
    p.add_argument("--output", required=True, help="folder to write (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="same seed, byte-identical safetensors")
    for name in SIZE_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(size, name))
    p.add_argument("--num-layers", type=int, default=None, help="default: 2, or 3 for MLA/GLM")
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="weights (default fp32)")
    p.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZE,
        help="int4-experts: routed experts in compressed-tensors pack-quantized W4A16",
    )
    p.add_argument("--qk-norm", default="on", choices=["on", "off"], help="glm4_moe use_qk_norm")
    p.add_argument("--index-topk", type=int, default=16, help="glm_moe_dsa: keys kept per query")
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        default=1024,
        help="the context length (default 1024; agents' prompts need 32768 or more)",
    )


def spec_from_args(args: argparse.Namespace) -> TinySpec:
    size = TinySize(
        num_layers=args.num_layers, **{name: getattr(args, name) for name in SIZE_FLAGS}
    )
    return TinySpec(
        arch=args.arch,
        seed=args.seed,
        size=size,
        quantize=args.quantize,
        dtype=args.dtype,
        qk_norm=args.qk_norm == "on",
        index_topk=args.index_topk,
        max_position_embeddings=args.max_position_embeddings,
    )


def run_make_tiny_model(args: argparse.Namespace) -> int:
    """Write the checkpoint; print one JSON line saying where and what."""
    from kvmesh_apps.tools.tiny_models import make_tiny_model

    result = make_tiny_model(spec_from_args(args), Path(args.output))
    print(json.dumps(result.as_dict()))
    return 0
