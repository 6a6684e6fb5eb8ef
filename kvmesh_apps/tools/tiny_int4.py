"""`--quantize int4-experts`: the routed experts rewritten in compressed-tensors' pack-quantized
W4A16 format, as Kimi K2 Thinking ships it, with compressed-tensors' own functions (scales by
its `calculate_qparams`, quantize + pack by its `PackedQuantizationCompressor`, the config by
its `QuantizationConfig`), so the format is the library's, not our reading of it.

Per expert linear `model.layers.L.mlp.experts.E.{gate,up,down}_proj`: `weight_packed` int32
[out, in/8] (eight signed int4 values + 8 per word, value j in bits 4j..4j+3), `weight_scale`
bf16 [out, in/32] (symmetric: w = value * scale), `weight_shape` int32 [2] = (out, in).
Everything else (attention, shared experts, dense MLPs, routers, lm_head) stays as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from kvmesh.errors import InvalidRequestError
from kvmesh_apps.tools.tiny_configs import INT4_GROUP

EXPERT_WEIGHT = re.compile(r"^(.+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj)\.weight$")
KIMI_IGNORE = (  # Kimi K2 Thinking's list, plus the router (a Linear in vLLM, never quantized)
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "re:.*mlp\\.gate$",
)


def quantization_config(group_size: int = INT4_GROUP) -> dict[str, Any]:
    """config.json's `quantization_config`, serialised by compressed-tensors itself."""
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(
        config_groups={"group_0": _scheme(group_size)},
        format="pack-quantized",
        ignore=list(KIMI_IGNORE),
        quantization_status="compressed",
    ).model_dump()


def _scheme(group_size: int) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size
    )
    return QuantizationScheme(targets=["Linear"], weights=weights)


def pack_expert(prefix: str, weight: torch.Tensor, group_size: int = INT4_GROUP) -> dict:
    """{prefix.weight_packed, prefix.weight_scale, prefix.weight_shape} of one [out, in] weight."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _scheme(group_size)
    groups = weight.float().unflatten(-1, (-1, group_size))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    packed["weight_shape"] = packed["weight_shape"].to(torch.int32)  # the library's is int64
    return {f"{prefix}.{name}": tensor.contiguous() for name, tensor in sorted(packed.items())}


def quantize_experts(output: Path, group_size: int = INT4_GROUP) -> int:
    """Rewrite output's model.safetensors and config.json in place; returns experts' linears."""
    from safetensors.torch import load_file, save_file

    path = output / "model.safetensors"
    if not path.is_file():
        raise InvalidRequestError(f"int4 experts need one model.safetensors in {output}")
    tensors: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in load_file(path).items():
        match = EXPERT_WEIGHT.match(name)
        if match is None:
            tensors[name] = tensor
            continue
        tensors.update(pack_expert(match.group(1), tensor, group_size))
        count += 1
    save_file(tensors, path, metadata={"format": "pt"})
    _add_to_config(output / "config.json", quantization_config(group_size))
    return count


def _add_to_config(path: Path, quantization: dict[str, Any]) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    config["quantization_config"] = quantization
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
