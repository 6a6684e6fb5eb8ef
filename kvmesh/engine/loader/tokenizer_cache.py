"""A model's HF tokenizer; a GGUF's is built once and then loaded from a saved folder.

transformers builds a GGUF's tokenizer by parsing the file's whole vocabulary and merge list
(seconds per process, in every worker and the gateway). The first build is saved with
`save_pretrained` next to the converted model (same source key, so a changed GGUF misses) and
later starts load that folder. The folder is written under a temporary name and renamed whole:
one that exists is complete, and when two processes race the first rename wins. A saved folder
of the plain fast tokenizer class is loaded through that class: AutoTokenizer would pick the same
one after walking every model's module of transformers, in every process's start.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import structlog

from kvmesh import env
from kvmesh.engine.loader.model_cache import CacheStatus, build_lock, entry_path, remove_stale
from kvmesh.engine.loader.resolve import ModelSource
from kvmesh.errors import ModelFormatError

log = structlog.get_logger(__name__)


def load_hf_tokenizer(source: ModelSource) -> Any:
    """The HF fast tokenizer of `source` (ModelFormatError when none can be built)."""
    start = time.perf_counter()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        if source.gguf_file is None:
            hf, cache = _from_pretrained(str(source.hf_dir)), "off"
        elif env.model_cache():
            hf, cache = _cached(source.gguf_file)
        else:
            hf, cache = _from_gguf(source.gguf_file), "off"
    except Exception as exc:
        raise ModelFormatError(f"cannot build a tokenizer for {source.name}: {exc}") from exc
    log.info("tokenizer.loaded", cache=cache, seconds=round(time.perf_counter() - start, 3))
    return hf


def _cached(gguf: Path) -> tuple[Any, CacheStatus]:
    folder = entry_path(gguf, "tokenizer")
    hf = _saved(folder)
    if hf is None:
        with build_lock(folder):  # workers starting together: one builds, the rest load
            hf = _saved(folder)
            if hf is None:
                hf = _from_gguf(gguf)
                shutil.rmtree(folder, ignore_errors=True)  # a damaged one, if any
                _save(hf, folder)
                return hf, "miss"
    return hf, "hit"


def _saved(folder: Path) -> Any | None:
    if not folder.is_dir():
        return None
    try:
        return _from_saved(folder)
    except Exception as exc:  # noqa: BLE001 - a damaged folder: built again from the GGUF
        log.warning("tokenizer_cache.unreadable", path=str(folder), error=repr(exc))
        return None


def _save(hf: Any, folder: Path) -> None:
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(str(tmp))
        os.rename(tmp, folder)  # fails if another process got there first: its folder is equal
        remove_stale(folder)
    except OSError as exc:
        log.info("tokenizer_cache.not_saved", path=str(folder), error=str(exc))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_gguf(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers 5 and 4 names


def _from_saved(folder: Path) -> Any:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") not in PLAIN_FAST:
        return _from_pretrained(str(folder))
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _from_pretrained(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
