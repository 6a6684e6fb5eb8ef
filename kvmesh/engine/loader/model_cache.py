"""The converted-model cache: a GGUF's converted state dict, stored once, mmap-loaded after.

Converting a GGUF costs seconds at every worker start (parsing ~100k metadata strings,
dequantizing, undoing llama.cpp's Q/K row permutation). An entry holds exactly what
`load_gguf` returns, already cast to the compute dtype (dense) or as INT4 (q, scale, zero)
triplets plus fp32 tensors (int4), in one safetensors file under $KVMESH_HOME/cache/models.
safetensors maps it privately, so workers on one host share its pages.

Keyed by the source file's identity (real path, size, mtime, inode), CONVERTER_VERSION and the
variant: a changed source misses and its stale entries are removed. Each entry is written to
a temporary file and renamed into place, so workers starting at once never read a partial file
(each either finds a complete entry or converts and renames its own; the bytes are equal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog

from kvmesh import env
from kvmesh.engine.config import ModelConfig, RopeScaling
from kvmesh.errors import KvmeshError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

CONVERTER_VERSION = 1  # bump whenever load_gguf's output (names, values, layout) changes
_INT4_PARTS = ("q", "scale", "zero")
_UNCAST = frozenset({"rope_freqs"})  # read as they are by the model (not cast to its dtype)
CacheStatus = Literal["hit", "miss", "off"]
_ENTRY_NAME = re.compile(r"^\.?([0-9a-f]{16})\.")  # KEY.kind, or .KEY.kind.pid.uuid.tmp / .lock


@dataclass(frozen=True)
class LoadedModel:
    """What a load produced; `cache` says how (off: no cache for this source or disabled)."""

    config: ModelConfig
    weights: dict[str, Any]  # HF names -> tensors (or Int4Weight), fresh dict per load
    cache: CacheStatus
    seconds: float


def cache_root() -> Path:
    return env.kvmesh_home() / "cache"


def source_key(path: Path) -> str:
    """The source file's identity (size, mtime, inode) and the converter version, as hex."""
    st = path.resolve().stat()
    ident = f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|v{CONVERTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def entry_path(path: Path, kind: str) -> Path:
    """An entry of source `path`: kind "fp32.safetensors", "config.json", "tokenizer", ...
    One folder per source path; file names start with the source's current key."""
    real = path.resolve()
    folder = f"{real.stem}-{hashlib.sha256(str(real).encode()).hexdigest()[:8]}"
    return cache_root() / "models" / folder / f"{source_key(path)}.{kind}"


def load_cached(
    gguf: Path, variant: str, convert: Callable[[], tuple[ModelConfig, dict[str, Any]]]
) -> LoadedModel:
    """The entry for (gguf, variant) if one is complete and readable, else `convert()` stored
    as one."""
    start = time.perf_counter()
    target = entry_path(gguf, f"{variant}.safetensors")
    found = read_entry(target)
    if found is None:
        with build_lock(target):  # workers starting together: one converts, the rest read
            found = read_entry(target)
            if found is None:
                config, weights = convert()
                weights = stored_form(weights, variant)
                _logged(target, lambda: write_entry(target, config, weights))
                return LoadedModel(config, weights, "miss", time.perf_counter() - start)
    return LoadedModel(*found, cache="hit", seconds=time.perf_counter() - start)


def _logged(target: Path, write: Callable[[], None]) -> None:
    """`write()`; a failure (a full disk, a read-only home) is logged: the cache only saves time."""
    try:
        write()
    except OSError as exc:
        log.warning("model_cache.write_failed", path=str(target), error=str(exc))


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """An advisory lock beside `path` while one process builds it (saves the others the work;
    correctness rests on the atomic rename, so no lock -- e.g. a read-only cache -- is fine)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(f".{path.name}.lock").open("a")
    except (ImportError, OSError):
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_config(gguf: Path, read: Callable[[], ModelConfig]) -> ModelConfig:
    """`read()` (the GGUF's metadata: seconds of parsing) once per source, then a JSON file."""
    target = entry_path(gguf, "config.json")
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, KvmeshError):
        return config_from_json(target.read_text())
    config = read()
    _logged(target, lambda: _write_text(target, config_to_json(config)))
    return config


def _write_text(target: Path, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def stored_form(weights: dict[str, Any], variant: str) -> dict[str, Any]:
    """Dense variants: floats cast to the dtype the model would cast them to (bit-identical);
    int4: as loaded (the model quantizes or casts fp32 sources itself)."""
    if variant == "int4":
        return dict(weights)
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[variant]
    return {n: w if n in _UNCAST else w.to(dtype).contiguous() for n, w in weights.items()}


def read_entry(path: Path) -> tuple[ModelConfig, dict[str, Any]] | None:
    """(config, weights) of a complete entry; None if absent or unreadable (then rebuilt)."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        return config_from_json(meta["config"]), _join_int4(tensors, json.loads(meta["int4"]))
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file is rebuilt, not fatal
        log.warning("model_cache.unreadable", path=str(path), error=repr(exc))
        return None


def write_entry(path: Path, config: ModelConfig, weights: dict[str, Any]) -> None:
    """Atomically: a private temporary file in the same folder, then one rename."""
    from safetensors.torch import save_file

    tensors, groups = _split_int4(weights)
    meta = {"config": config_to_json(config), "int4": json.dumps(groups),
            "converter_version": str(CONVERTER_VERSION)}  # fmt: skip
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    remove_stale(path)
    log.info("model_cache.written", path=str(path), bytes=path.stat().st_size)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary sibling of `path` to write; renamed onto `path` if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # safetensors' own temporaries are 0600
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def remove_stale(path: Path) -> None:
    """Every entry in `path`'s folder under another key: the source changed, or the converter.
    Only names of ours (`KEY.kind`, `.KEY.kind...` temporaries and locks): a writer's own
    temporary files (safetensors makes some) are left alone. Readers keep their mappings."""
    key = path.name.split(".", 1)[0]
    for other in path.parent.iterdir():
        found = _ENTRY_NAME.match(other.name)
        if found is None or found.group(1) == key:
            continue
        with contextlib.suppress(FileNotFoundError):
            if other.is_dir():
                shutil.rmtree(other)
            else:
                other.unlink()
            log.info("model_cache.removed_stale", path=str(other))


def _split_int4(weights: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    from kvmesh.engine.quant.int4 import Int4Weight

    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, int] = {}
    for name, w in weights.items():
        if isinstance(w, Int4Weight):
            groups[name] = w.group
            tensors.update({f"{name}#{p}": getattr(w, p).contiguous() for p in _INT4_PARTS})
        else:
            tensors[name] = w.contiguous()
    return tensors, groups


def _join_int4(tensors: dict[str, torch.Tensor], groups: dict[str, int]) -> dict[str, Any]:
    if not groups:
        return tensors
    from kvmesh.engine.quant.int4 import Int4Weight

    weights: dict[str, Any] = {n: t for n, t in tensors.items() if "#" not in n}
    for name, group in groups.items():
        weights[name] = Int4Weight(*(tensors[f"{name}#{p}"] for p in _INT4_PARTS), group)
    return weights


def config_to_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def config_from_json(text: str) -> ModelConfig:
    raw = json.loads(text)
    raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    return ModelConfig(**raw)
