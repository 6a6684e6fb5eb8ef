"""The converted-model cache: a GGUF's converted state dict, stored once, read lazily after.

Converting a GGUF costs seconds at every worker start (parsing ~100k metadata strings,
dequantizing, undoing llama.cpp's Q/K row permutation). An entry holds exactly what
`load_gguf` returns, already cast to the compute dtype (dense) or as INT4 (q, scale, zero)
triplets plus fp32 tensors (int4), in one safetensors file under $KVMESH_HOME/cache/models
(the format: cache_entry.py). A load reads each tensor when the model asks for it, into memory
of its own (not a mapping of the file: see lazy_weights).

Keyed by the source file's identity (real path, size, mtime, inode), CONVERTER_VERSION and the
variant: a changed source misses and its stale entries are removed. Each entry is written to
a temporary file and renamed into place, so workers starting at once never read a partial file
(each either finds a complete entry or converts and renames its own; the bytes are equal).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

from kvmesh import env
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.cache_entry import (
    CONVERTER_VERSION,
    config_from_json,
    config_to_json,
    open_entry,
    stored_form,
    write_tensors,
)
from kvmesh.engine.loader.lazy_weights import LazyWeights
from kvmesh.errors import KvmeshError

log = structlog.get_logger(__name__)

__all__ = [
    "CONVERTER_VERSION",
    "LoadedModel",
    "config_from_json",
    "config_to_json",
    "entry_path",
    "load_cached",
    "open_entry",
    "write_entry",
]
CacheStatus = Literal["hit", "miss", "off"]
_ENTRY_NAME = re.compile(r"^\.?([0-9a-f]{16})\.")  # KEY.kind, or .KEY.kind.pid.uuid.tmp / .lock


@dataclass(frozen=True)
class LoadedModel:
    """What a load produced; `cache` says how (off: no cache for this source or disabled)."""

    config: ModelConfig
    weights: LazyWeights  # HF names -> tensors (or Int4Weight), read on access; fresh per load
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
    gguf: Path, variant: str, convert: Callable[[], tuple[ModelConfig, Mapping[str, Any]]]
) -> LoadedModel:
    """The entry for (gguf, variant) if one is complete and readable, else `convert()` stored
    as one (tensor by tensor) and then read from it; both lazily (see lazy_weights)."""
    start = time.perf_counter()
    target = entry_path(gguf, f"{variant}.safetensors")
    found = open_entry(target)
    if found is None:
        with build_lock(target):  # workers starting together: one converts, the rest read
            found = open_entry(target)
            if found is None:
                config, weights = convert()
                stored = stored_form(weights, variant)
                if _logged(target, lambda: write_entry(target, config, stored)):
                    found = open_entry(target)
                if found is None:  # not written: served from the source, cast as stored
                    return LoadedModel(config, stored, "miss", time.perf_counter() - start)
                stored.close()
                return LoadedModel(*found, cache="miss", seconds=time.perf_counter() - start)
    return LoadedModel(*found, cache="hit", seconds=time.perf_counter() - start)


def _logged(target: Path, write: Callable[[], None]) -> bool:
    """`write()`; a failure (a full disk, a read-only home) is logged: the cache only saves time."""
    try:
        write()
    except OSError as exc:
        log.warning("model_cache.write_failed", path=str(target), error=str(exc))
        return False
    return True


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


def write_entry(path: Path, config: ModelConfig, weights: Mapping[str, Any]) -> None:
    """Atomically: a private temporary file in the same folder, streamed, then one rename."""
    with atomic_path(path) as tmp:
        write_tensors(tmp, config, weights)
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
