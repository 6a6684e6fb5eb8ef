"""Read an HF folder: config.json plus one or many (indexed) safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.hf_config import config_from_hf
from kvmesh.errors import ModelFormatError


def load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    try:
        config = config_from_hf(json.loads((folder / "config.json").read_text()))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelFormatError(f"{folder}/config.json is invalid: {exc}") from exc
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        try:
            weights.update(load_file(str(file)))
        except Exception as exc:
            raise ModelFormatError(f"{file} is not a readable safetensors file: {exc}") from exc
    return config, weights


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
