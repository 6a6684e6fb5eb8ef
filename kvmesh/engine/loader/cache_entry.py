"""One converted-model cache entry: a safetensors file of a GGUF's converted tensors -- dense
ones in the variant's dtype, each INT4 weight as a (q, scale, zero) triplet named `NAME#q`,
`NAME#scale`, `NAME#zero` -- with the config and the INT4 group sizes in its metadata.

Written as a stream (one tensor in memory at a time) and read lazily (a LazyWeights over the
file: an INT4 weight's triplet is joined when its name is read).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kvmesh.engine.config import ModelConfig, RopeScaling
from kvmesh.engine.loader.lazy_weights import LazyWeights, Reader, as_dtype
from kvmesh.errors import KvmeshError

if TYPE_CHECKING:
    import torch

    from kvmesh.engine.loader.safetensors_io import SafetensorsFile

log = structlog.get_logger(__name__)

CONVERTER_VERSION = 1  # bump whenever load_gguf's output (names, values, layout) changes
_INT4_PARTS = ("q", "scale", "zero")
_UNCAST = frozenset({"rope_freqs"})  # read as they are by the model (not cast to its dtype)
_ENTRY_ROOM = 192  # header bytes one tensor's entry takes at most (a few dims, 12-digit offsets)


def stored_form(weights: Mapping[str, Any], variant: str) -> LazyWeights:
    """Dense variants: floats cast to the dtype the model would cast them to (bit-identical),
    each when it is read; int4: as loaded (the model quantizes or casts fp32 sources itself)."""
    weights = LazyWeights.of(weights)
    if variant == "int4":
        return weights
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[variant]

    def read(name: str, wanted: torch.dtype | None) -> Any:
        return as_dtype(weights.read(name, None if name in _UNCAST else dtype), wanted)

    return weights.derive({name: functools.partial(read, name) for name in weights})


def write_tensors(path: Path, config: ModelConfig, weights: Mapping[str, Any]) -> None:
    """`weights` (tensors or Int4Weights) into a new safetensors file at `path`, read and
    written one at a time."""
    from kvmesh.engine.loader.safetensors_io import SafetensorsWriter
    from kvmesh.engine.quant.int4 import Int4Weight

    meta = {"config": config_to_json(config), "converter_version": str(CONVERTER_VERSION)}
    room = len(json.dumps(meta)) + 64 + sum(4 * len(n) + 3 * _ENTRY_ROOM for n in weights)
    groups: dict[str, int] = {}
    with SafetensorsWriter(path, room) as out:
        for name in weights:
            weight = weights[name]
            if isinstance(weight, Int4Weight):
                groups[name] = weight.group
                for part in _INT4_PARTS:
                    out.add(f"{name}#{part}", getattr(weight, part))
            else:
                out.add(name, weight)
            del weight  # before the next is read
        out.finish({**meta, "int4": json.dumps(groups)})


def open_entry(path: Path) -> tuple[ModelConfig, LazyWeights] | None:
    """(config, weights) of a complete entry; None if absent or unreadable (then rebuilt)."""
    if not path.is_file():
        return None
    from kvmesh.engine.loader.safetensors_io import SafetensorsFile

    try:
        file = SafetensorsFile(path)
    except (OSError, KvmeshError) as exc:  # a torn or foreign file is rebuilt, not fatal
        log.warning("model_cache.unreadable", path=str(path), error=repr(exc))
        return None
    try:
        config = config_from_json(file.metadata["config"])
        int4 = json.loads(file.metadata["int4"])
        readers = _entry_readers(file, int4)
    except Exception as exc:  # noqa: BLE001 - metadata of another writer: rebuilt
        file.close()
        log.warning("model_cache.unreadable", path=str(path), error=repr(exc))
        return None
    slicers = {n: functools.partial(file.read_slice, n) for n in readers if n not in int4}
    return config, LazyWeights(readers, [file], slicers)  # a rank reads its part of a dense one


def _entry_readers(file: SafetensorsFile, groups: dict[str, int]) -> dict[str, Reader]:
    readers: dict[str, Reader] = {
        name: functools.partial(file.read, name) for name in file.names if "#" not in name
    }
    for name, group in groups.items():
        missing = [p for p in _INT4_PARTS if f"{name}#{p}" not in file.entries]
        if missing or not isinstance(group, int):
            raise KeyError(f"INT4 weight {name} lacks {missing} or has group {group!r}")
        readers[name] = functools.partial(_int4, file, name, group)
    return readers


def _int4(file: SafetensorsFile, name: str, group: int, dtype: torch.dtype | None) -> Any:
    from kvmesh.engine.quant.int4 import Int4Weight

    return Int4Weight(*(file.read(f"{name}#{p}") for p in _INT4_PARTS), group)


def config_to_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def config_from_json(text: str) -> ModelConfig:
    raw = json.loads(text)
    raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    return ModelConfig(**raw)
