"""The default model through the converted-model and tokenizer caches: an engine started from
the cache holds the same weights, computes the same logits and tokenizes the same as the engine
that converted the GGUF (and filled the cache; a miss uses the converted tensors as they are,
which tests/unit/test_model_cache.py checks against the uncached loader)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.core import engine as engine_module
from kvmesh.engine.core.engine import Engine
from kvmesh.engine.loader import tokenizer_cache

TEXTS = ["Hello, world!", "  leading spaces\tand tabs\n", "naïve café — 東京 🙂", "<|im_end|> x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def _engine(model: str) -> Engine:
    return Engine(EngineConfig.of(model=model, dtype="fp32", kv_cache_bytes=16 << 20))


def _tensors(engine: Engine) -> dict[str, torch.Tensor]:
    """Every tensor the model holds, by attribute path (layers are objects of layer classes)."""
    out: dict[str, torch.Tensor] = {}

    def walk(path: str, value: object, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            out[path] = value
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(f"{path}.{i}", item, depth + 1)
        elif hasattr(value, "__dict__") and depth < 6:
            for key, item in vars(value).items():
                walk(f"{path}.{key}", item, depth + 1)

    model = engine.runner.model
    for name in ("embed", "norm", "lm_head", "layers"):
        walk(name, getattr(model, name))
    return out


def _no_conversion(*_: object) -> None:
    raise AssertionError("converted the GGUF although the cache holds it")


@pytest.fixture(scope="module")
def engines(default_model_source, tmp_path_factory) -> tuple[Engine, Engine]:
    """(converted the GGUF, started from the cache it filled: fails if it converts anything)."""
    model = str(default_model_source.gguf_file)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVMESH_HOME", str(Path(tmp_path_factory.mktemp("home"))))
        mp.delenv("KVMESH_MODEL_CACHE", raising=False)
        converted = _engine(model)
        mp.setattr(engine_module, "load_weights", _no_conversion)
        mp.setattr(tokenizer_cache, "_from_gguf", _no_conversion)
        cached = _engine(model)
    return converted, cached


def test_weights_and_logits_are_bit_identical(engines) -> None:
    converted, cached = engines
    a, b = _tensors(converted), _tensors(cached)
    assert a.keys() == b.keys() and len(a) > 30 * 5
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = converted.tokenizer.encode_chat(CHAT)
    assert torch.equal(converted.score(ids), cached.score(ids))


def test_the_cached_tokenizer_tokenizes_the_same(engines) -> None:
    a, b = (e.tokenizer for e in engines)
    assert type(b.hf) is type(a.hf)  # the saved folder loaded as the class AutoTokenizer built
    assert (a.vocab_size, a.eos_token_ids, a.all_special_ids) == (
        b.vocab_size,
        b.eos_token_ids,
        b.all_special_ids,
    )
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids
        assert b.decode(ids, skip_special_tokens=False) == a.decode(ids, skip_special_tokens=False)
    assert b.render_chat(CHAT) == a.render_chat(CHAT)
