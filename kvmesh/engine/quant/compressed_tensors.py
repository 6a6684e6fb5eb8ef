"""compressed-tensors `pack-quantized` INT4 checkpoints (Kimi K2 Thinking's W4A16 experts) read
into our `Int4Weight`, bit-exactly, without the compressed-tensors package.

The format (compressed-tensors 0.20 `PackedQuantizationCompressor`, symmetric int4, strategy
group): per quantized linear `prefix`, `prefix.weight_packed` int32 [out, ceil(in/8)] holds
value j of a row in bits 4j..4j+3 of word j // 8 (little-endian, so byte j // 2, low nibble
first) as the signed value + 8; `prefix.weight_scale` [out, in/group] (bf16 in Kimi's files);
`prefix.weight_shape` [2] = (out, in). compressed-tensors dequantizes w = value * scale. Our
Int4Weight computes w = (q - 8) * scale + zero, so q = the stored nibble, zero = 0: with the
scale in fp32 (bf16 -> fp32 is exact) both products are the same fp32 multiplication."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvmesh.engine.quant.int4 import Int4Weight
from kvmesh.errors import ModelFormatError

FORMAT = "pack-quantized"
METHOD = "compressed-tensors"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


class TensorSource(Protocol):
    """A dict of tensors or a lazy mapping over safetensors files."""

    def __getitem__(self, name: str) -> torch.Tensor: ...
    def __contains__(self, name: object) -> bool: ...
    def pop(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """The one scheme we read: W4A16, symmetric int, per-group scales along the inputs."""

    group_size: int
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ModelFormatError(f"compressed-tensors group_size {self.group_size} unsupported")
        for target in self.targets:
            if _is_class_name(target) and target != "Linear":
                raise ModelFormatError(f"compressed-tensors target class {target!r} unsupported")

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any]) -> CompressedTensorsScheme:
        """From config.json's `quantization_config`; ModelFormatError naming what we lack."""
        _check_top_level(quantization_config)
        groups = quantization_config.get("config_groups") or {}
        if not groups:
            raise ModelFormatError("compressed-tensors config without config_groups")
        sizes = {_group_size(name, group) for name, group in groups.items()}
        if len(sizes) != 1:
            raise ModelFormatError(f"compressed-tensors groups of several group sizes {sizes}")
        targets = tuple(t for group in groups.values() for t in group.get("targets") or ())
        ignore = tuple(quantization_config.get("ignore") or ())
        return cls(group_size=sizes.pop(), targets=targets, ignore=ignore)

    def quantizes(self, module_name: str) -> bool:
        """Whether the linear module `module_name` (e.g. `model.layers.1.mlp.experts.0.up_proj`)
        is stored quantized, by compressed-tensors' name rules: `re:` entries are `re.match`
        (anchored at the start only), others exact names; the class target `Linear` takes every
        module asked about (ask about linear layers only, one shard of a fused layer at a time).
        """
        if "Linear" in self.ignore or any(_matches(module_name, i) for i in self.ignore):
            return False
        return any(t == "Linear" or _matches(module_name, t) for t in self.targets)


def is_pack_quantized(hf_config: Mapping[str, Any]) -> bool:
    """Whether a config.json says compressed-tensors pack-quantized (any scheme inside)."""
    config = hf_config.get("quantization_config") or hf_config.get("compression_config") or {}
    return config.get("quant_method") == METHOD and config.get("format") == FORMAT


def read_pack_quantized(
    weights: TensorSource, prefix: str, scheme: CompressedTensorsScheme
) -> Int4Weight:
    """The Int4Weight of linear `prefix`, popping its three tensors from weights."""
    names = [f"{prefix}.{suffix}" for suffix in SUFFIXES]
    missing = [name for name in names if name not in weights]
    if missing:
        raise ModelFormatError(f"pack-quantized {prefix}: missing {', '.join(missing)}")
    if f"{prefix}.weight_zero_point" in weights:
        raise ModelFormatError(
            f"pack-quantized {prefix}: a zero point, but the scheme is symmetric"
        )
    packed, scale, shape = (weights.pop(name) for name in names)
    rows, cols = _shape(prefix, shape)
    _check_shapes(prefix, packed, scale, rows, cols, scheme.group_size)
    return Int4Weight(
        _nibbles(packed, rows, cols),
        scale.float().contiguous(),
        torch.zeros(scale.shape, dtype=torch.float32),
        scheme.group_size,
    )


def _nibbles(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """uint8 [rows, cols] in 0..15: value j of each row from bits 4j..4j+3 of the row's words."""
    data = packed.contiguous().view(torch.uint8).view(rows, -1, 4)
    if sys.byteorder == "big":
        data = data.flip(-1)
    data = data.reshape(rows, -1)
    return torch.stack((data & 15, data >> 4), dim=-1).view(rows, -1)[:, :cols].contiguous()


def _check_top_level(config: Mapping[str, Any]) -> None:
    if config.get("quant_method") != METHOD:
        raise ModelFormatError(f"quant_method {config.get('quant_method')!r} is not {METHOD}")
    if config.get("format") != FORMAT:
        raise ModelFormatError(
            f"compressed-tensors format {config.get('format')!r} unsupported (only {FORMAT})"
        )
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(key):
            raise ModelFormatError(f"compressed-tensors {key} unsupported")


def _group_size(name: str, group: Mapping[str, Any]) -> int:
    """The group size of one config group, after checking it is W4A16 symmetric int groups."""
    if group.get("format") not in (None, FORMAT):
        raise ModelFormatError(f"compressed-tensors {name} format {group['format']!r} unsupported")
    if group.get("input_activations") or group.get("output_activations"):
        raise ModelFormatError(f"compressed-tensors {name}: activation quantization unsupported")
    w = group.get("weights") or {}
    wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    wrong = {key: w.get(key) for key, value in wanted.items() if w.get(key) != value}
    if w.get("dynamic") or w.get("actorder") not in (None, "static"):
        wrong.update(dynamic=w.get("dynamic"), actorder=w.get("actorder"))
    if wrong:
        raise ModelFormatError(
            f"compressed-tensors {name} weights {wrong} unsupported (only {wanted})"
        )
    if not isinstance(w.get("group_size"), int):
        raise ModelFormatError(f"compressed-tensors {name}: no integer group_size")
    return w["group_size"]


def _shape(prefix: str, shape: torch.Tensor) -> tuple[int, int]:
    if shape.dtype.is_floating_point or shape.dtype == torch.bool or tuple(shape.shape) != (2,):
        raise ModelFormatError(f"pack-quantized {prefix}: weight_shape is not 2 integers")
    rows, cols = (int(v) for v in shape.tolist())
    return rows, cols


def _check_shapes(
    prefix: str, packed: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, group: int
) -> None:
    if cols % group:
        raise ModelFormatError(f"pack-quantized {prefix}: {cols} inputs, groups of {group}")
    expect = {"weight_packed": (rows, -(-cols // 8)), "weight_scale": (rows, cols // group)}
    for name, tensor in (("weight_packed", packed), ("weight_scale", scale)):
        if tuple(tensor.shape) != expect[name]:
            raise ModelFormatError(
                f"pack-quantized {prefix}: {name} {tuple(tensor.shape)}, "
                f"expected {expect[name]} for weight_shape {(rows, cols)}"
            )
    if packed.dtype != torch.int32 or not scale.dtype.is_floating_point:
        raise ModelFormatError(f"pack-quantized {prefix}: dtypes {packed.dtype}, {scale.dtype}")


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _is_class_name(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()
