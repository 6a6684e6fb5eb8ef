"""Shared fixtures. The real default model is fetched once (make test does it before pytest),
and so are the CPU kernels: every process the tests start, whatever its KVMESH_HOME, loads the
one build (compiling it again per home took ~2 minutes a time on a slow machine)."""

from __future__ import annotations

import os
import signal

import pytest

from kvmesh import env

os.environ.setdefault("KVMESH_KERNELS_DIR", str(env.kernels_dir()))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(autouse=True)
def _sigterm_tears_down() -> None:
    """A SIGTERM to pytest (CI's timeout, a stopped job) unwinds like Ctrl-C: the fixtures'
    teardowns stop what they started (meshes, the image test's containers, which nothing else
    would stop). Set before every test: asyncio's remove_signal_handler resets it."""
    signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def default_model_source():
    from kvmesh.engine.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def llm():
    """One fp32 engine on the default model, shared by the tests that only read from it."""
    from kvmesh import LLM

    return LLM(dtype="fp32", max_num_seqs=32)


@pytest.fixture(scope="session")
def hf_reference(default_model_source):
    """transformers' LlamaForCausalLM on the same GGUF (dequantized to fp32 by transformers)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    gguf = default_model_source.gguf_file
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()
