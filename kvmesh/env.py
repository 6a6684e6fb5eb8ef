"""Every environment knob kvmesh reads, typed, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def kvmesh_home() -> Path:
    """Cache root for fetched models (`$KVMESH_HOME`, default `~/.cache/kvmesh`)."""
    return Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh")).expanduser()


def num_threads() -> int | None:
    """Torch intra-op threads (`KVMESH_NUM_THREADS`); None keeps torch's default."""
    value = os.environ.get("KVMESH_NUM_THREADS")
    return int(value) if value else None


def load_threads() -> int | None:
    """Torch threads while an engine loads its model and KV pool (`KVMESH_LOAD_THREADS`);
    None: the serving threads (see num_threads)."""
    value = os.environ.get("KVMESH_LOAD_THREADS")
    return int(value) if value else None


def log_level() -> str:
    return os.environ.get("KVMESH_LOG_LEVEL", "WARNING").upper()


def log_json() -> bool:
    return os.environ.get("KVMESH_LOG_JSON", "1") not in ("0", "false", "")


def model_cache() -> bool:
    """Keep converted models (and GGUF tokenizers) under $KVMESH_HOME/cache
    (`KVMESH_MODEL_CACHE`, default on; 0 converts the source at every start)."""
    return os.environ.get("KVMESH_MODEL_CACHE", "1") not in ("0", "false", "off", "")
