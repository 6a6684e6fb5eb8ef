"""A tensor-parallel rank reads only its part of a safetensors tensor: rows by one read,
columns through row chunks (never the whole tensor at once), through a pipeline stage's view
too; a converted tensor (no slicer) is read whole, then sliced."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from safetensors.torch import save_file

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader import safetensors_io
from kvmesh.engine.loader.lazy_weights import LazyWeights
from kvmesh.engine.loader.safetensors_io import SafetensorsFile
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.parallel.sharded_state import ShardedState
from kvmesh.engine.parallel.stage_state import StageState

Q, OUT, E = (
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.embed_tokens.weight",
)


def _config() -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=6,
        num_kv_heads=3,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in base.items() if k in names})


@pytest.fixture
def tensors(tmp_path):
    full = {
        Q: torch.randn(24, 8).to(torch.bfloat16),
        OUT: torch.randn(8, 24).to(torch.bfloat16),
        E: torch.randn(32, 8).to(torch.bfloat16),
    }
    path = tmp_path / "model.safetensors"
    save_file(full, str(path))
    file = SafetensorsFile(path)
    yield full, file
    file.close()


def test_rows_and_columns_are_read_alone(tensors, monkeypatch):
    full, file = tensors
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 3 * 48)  # 3 rows of o_proj a chunk
    assert torch.equal(file.read_slice(Q, 0, 8, 16), full[Q][8:24])
    got = file.read_slice(OUT, 1, 12, 12, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, full[OUT][:, 12:].float())
    with pytest.raises(ValueError, match="rows or the columns"):
        file.read_slice(Q, 2, 0, 1)


def test_a_ranks_view_reads_only_its_parts(tensors):
    full, file = tensors
    calls = []

    def slicer(name, *args):
        calls.append(name)
        return file.read_slice(name, *args)

    names = list(full)
    readers = {n: functools.partial(file.read, n) for n in names}
    lazy = LazyWeights(readers, (), {n: functools.partial(slicer, n) for n in names})
    config, shard = _config(), TensorShard(1, 2, stage=1, stages=2)
    state = ShardedState(StageState(lazy, config, shard), config, shard)
    local_q, local_o = Q.replace(".1.", ".0."), OUT.replace(".1.", ".0.")
    assert torch.equal(state.pop(local_q, dtype=torch.float32), full[Q][8:24].float())
    assert torch.equal(state.pop(local_o), full[OUT][:, 8:24])
    assert torch.equal(state.pop(E), full[E][16:])  # the tied table on the last stage
    assert calls == [Q, OUT, E]  # each through its slicer: never read whole
    whole = LazyWeights(readers)  # no slicers (a converted model): whole, then sliced
    state = ShardedState(whole, config, TensorShard(1, 2))
    assert torch.equal(state.pop(Q), full[Q][8:24]) and calls == [Q, OUT, E]


def test_gguf_parts_dequantize_only_their_rows_or_columns(default_model_source):
    """SmolLM2's GGUF (Q4_1 / Q8_0 blocks): a part equals the whole tensor's, read and cut,
    permuted Q/K rows included (whole heads unpermuted alone), in fp32 and bf16."""
    from kvmesh.engine.loader.gguf_loader import load_gguf

    parts = [
        ("model.layers.3.self_attn.q_proj.weight", 0, 192, 192),
        ("model.layers.3.self_attn.k_proj.weight", 0, 64, 128),
        ("model.layers.3.self_attn.o_proj.weight", 1, 192, 384),
        ("model.embed_tokens.weight", 0, 24576, 24576),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        _, weights = load_gguf(default_model_source.gguf_file)
        for name, dim, start, length in parts:
            assert weights.can_slice(name)
            whole = weights.read(name, dtype).narrow(dim, start, length)
            assert torch.equal(weights.pop_slice(name, dim, start, length, dtype), whole), name
        assert not weights.can_slice("model.norm.weight")  # a vector: read whole
