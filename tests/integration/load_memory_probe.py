"""Memory of a model load, measured in a fresh process (`ru_maxrss` is a lifetime peak).

python -m tests.integration.load_memory_probe load MODEL [--weights fp32|bf16|int4]
    Loads MODEL the way the engine does (load_model, then build_model) and prints one JSON
    line: RSS `baseline` (after torch, numpy, gguf, safetensors and the loader are
    imported), `peak`, `after`, the model's `weight_bytes`, `cache` and `seconds`.
python -m tests.integration.load_memory_probe make-llama FOLDER
    Writes a ~0.94 GB float32 Llama (hidden 1024, 20 layers) as 4 safetensors shards with
    an index, one shard in memory at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import gguf  # noqa: F401 - imported before the baseline, as the loader would import them
import safetensors.torch
import torch

import kvmesh.engine.loader.gguf_loader
import kvmesh.engine.loader.safetensors_loader  # noqa: F401
from kvmesh.config import Int4Scheme
from kvmesh.engine.loader import load_model, load_weights, resolve_model
from kvmesh.engine.loader.memory import current_rss_bytes, peak_rss_bytes
from kvmesh.engine.models import build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 20,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
SHARDS = 4


def measure(model: str, weights: str) -> dict:
    dtype = "bf16" if weights == "int4" else weights
    int4 = Int4Scheme() if weights == "int4" else None
    source = resolve_model(model)
    baseline = current_rss_bytes()
    start = time.perf_counter()
    loaded = load_model(source, int4 is not None, dtype, load_weights)
    config, state, cache = loaded.config, loaded.weights, loaded.cache
    del loaded
    built = build_model(config, state, DTYPES[dtype], config.max_position_embeddings, int4)
    del state
    return {
        "baseline": baseline,
        "peak": peak_rss_bytes(),
        "after": current_rss_bytes(),
        "weight_bytes": built.weight_bytes,
        "cache": cache,
        "seconds": round(time.perf_counter() - start, 2),
    }


def llama_shapes(c: dict = LLAMA) -> dict[str, tuple[int, ...]]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def make_llama(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shapes = llama_shapes()
    names = list(shapes)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for s in range(SHARDS):
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = names[s * len(names) // SHARDS : (s + 1) * len(names) // SHARDS]
        shard = {n: torch.randn(shapes[n], generator=gen).mul_(0.02) for n in part}
        safetensors.torch.save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
        del shard
    total = 4 * sum(math.prod(shape) for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(LLAMA))


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    load = commands.add_parser("load")
    load.add_argument("model")
    load.add_argument("--weights", choices=["fp32", "bf16", "int4"], default="fp32")
    commands.add_parser("make-llama").add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.command == "make-llama":
        make_llama(args.folder)
    else:
        print(json.dumps(measure(args.model, args.weights)))


if __name__ == "__main__":
    main()
