"""Read an HF folder: config.json plus one or many (indexed) safetensors files, each tensor
read when asked for (see lazy_weights)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.hf_config import config_from_hf
from kvmesh.engine.loader.lazy_weights import LazyWeights, Reader, Slicer
from kvmesh.engine.loader.safetensors_io import SafetensorsFile
from kvmesh.errors import ModelFormatError


def load_hf_folder(folder: Path) -> tuple[ModelConfig, LazyWeights]:
    """The config and every shard's tensors by name (a later shard's name wins, as a merged
    dict would), in the files' own dtypes. Every header is read here: a missing, truncated or
    foreign shard fails now, not at the first read."""
    try:
        config = config_from_hf(json.loads((folder / "config.json").read_text()))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelFormatError(f"{folder}/config.json is invalid: {exc}") from exc
    shards: list[SafetensorsFile] = []
    readers: dict[str, Reader] = {}
    slicers: dict[str, Slicer] = {}
    try:
        for file in safetensors_files(folder):
            shards.append(SafetensorsFile(file))
            readers.update({n: functools.partial(shards[-1].read, n) for n in shards[-1].names})
            slicers.update(
                {n: functools.partial(shards[-1].read_slice, n) for n in shards[-1].names}
            )
    except BaseException:
        for shard in shards:
            shard.close()
        raise
    return config, LazyWeights(readers, shards, slicers)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFormatError(f"{index} is invalid: {exc!r}") from exc
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ModelFormatError(f"no safetensors weights in {folder} (missing: {missing or 'all'})")
    return files
