"""Tensor-parallel shards as data: head and feature ranges, the rank's config, a checkpoint
sliced as each tensor is taken (dense and INT4), the row-parallel biases on rank 0 only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.parallel.sharded_state import ShardedState
from kvmesh.engine.parallel.stage_state import StageState
from kvmesh.engine.quant.int4 import Int4Weight
from kvmesh.errors import InvalidRequestError, ModelFormatError


def _config(**fields) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=8,
        intermediate_size=64,
        num_layers=1,
        num_heads=6,
        num_kv_heads=3,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in {**base, **fields}.items() if k in names})


def test_ranges_keep_gqa_groups_whole_and_cover_everything():
    config = _config()
    shards = [TensorShard(r, 2) for r in range(2)]
    assert [list(s.kv_heads(config)) for s in shards] == [[0], [1, 2]]
    assert [list(s.q_heads(config)) for s in shards] == [[0, 1], [2, 3, 4, 5]]
    assert [s.features(config) for s in shards] == [range(0, 32), range(32, 64)]
    local = shards[1].local_config(config)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 2, 32)
    with pytest.raises(InvalidRequestError, match="exceeds the model's 3 KV heads"):
        TensorShard(0, 4).local_config(config)


def test_a_checkpoint_sliced_as_each_tensor_is_taken():
    config = _config()
    p = "model.layers.0."
    state = {
        p + "self_attn.q_proj.weight": torch.arange(24 * 8.0).view(24, 8),
        p + "self_attn.k_proj.weight": torch.arange(12 * 8.0).view(12, 8),
        p + "self_attn.o_proj.weight": torch.arange(8 * 24.0).view(8, 24),
        p + "self_attn.o_proj.bias": torch.ones(8),
        p + "mlp.down_proj.weight": torch.arange(8 * 64.0).view(8, 64),
        p + "input_layernorm.weight": torch.ones(8),
        "model.embed_tokens.weight": torch.arange(32 * 8.0).view(32, 8),
    }
    one = ShardedState(dict(state), config, TensorShard(1, 2))
    assert p + "self_attn.o_proj.bias" not in one  # row-parallel bias: rank 0's
    assert sorted(one.keys()) == sorted(n for n in state if not n.endswith("o_proj.bias"))
    q = one.pop(p + "self_attn.q_proj.weight")
    assert torch.equal(q, state[p + "self_attn.q_proj.weight"][8:24])  # heads 2-5, 4 rows each
    assert torch.equal(
        one.pop(p + "self_attn.k_proj.weight"), state[p + "self_attn.k_proj.weight"][4:12]
    )
    o = one.pop(p + "self_attn.o_proj.weight", dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16 and torch.equal(
        o.float(), state[p + "self_attn.o_proj.weight"][:, 8:24]
    )
    assert torch.equal(
        one.pop(p + "mlp.down_proj.weight"), state[p + "mlp.down_proj.weight"][:, 32:]
    )
    assert torch.equal(one.pop(p + "input_layernorm.weight"), torch.ones(8))  # replicated
    table = one.pop("model.embed_tokens.weight")  # rows by token id
    assert torch.equal(table, state["model.embed_tokens.weight"][16:])
    zero = ShardedState(dict(state), config, TensorShard(0, 2))
    assert torch.equal(zero.pop(p + "self_attn.o_proj.bias"), torch.ones(8))


def test_int4_weights_split_by_rows_and_by_whole_groups():
    weight = Int4Weight.quantize(torch.randn(8, 64), group=32, search=False)
    rows, cols = weight.narrow(0, 2, 4), weight.narrow(1, 32, 32)
    assert torch.equal(rows.dequantize(), weight.dequantize()[2:6])
    assert torch.equal(cols.dequantize(), weight.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="split a group of 32"):
        weight.narrow(1, 16, 48)
    config = _config(hidden_size=64, intermediate_size=48)
    name = "model.layers.0.mlp.down_proj.weight"
    state = ShardedState(
        {name: Int4Weight.quantize(torch.randn(64, 48), group=8, search=False)},
        config,
        TensorShard(1, 2),
    )
    assert state.pop(name).shape == (64, 24)  # features 24-48: whole groups of 8
    state = ShardedState(
        {name: Int4Weight.quantize(torch.randn(64, 48), group=16, search=False)},
        config,
        TensorShard(1, 2),
    )
    with pytest.raises(ModelFormatError, match="cannot be split over the ranks"):
        state.pop(name)  # features 24-48 cut a group of 16


def test_pipeline_stages_renumber_their_layers_and_keep_their_ends():
    config = _config(num_layers=4)
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)]
    state = {n: torch.full((2, 2), float(i)) for i, n in enumerate(names)}
    state |= {
        "model.embed_tokens.weight": torch.zeros(2),
        "model.norm.weight": torch.ones(2),
        "lm_head.weight": torch.ones(3),
    }
    first, last = TensorShard(0, 1, stage=0, stages=2), TensorShard(0, 1, stage=1, stages=2)
    assert (first.layers(config), last.layers(config)) == (range(0, 2), range(2, 4))
    assert last.local_config(config).num_layers == 2
    head = StageState(dict(state), config, first)
    assert sorted(head.keys()) == sorted([*names[:2], "model.embed_tokens.weight"])
    tail = StageState(dict(state), config, last)
    assert sorted(tail.keys()) == sorted([*names[:2], "model.norm.weight", "lm_head.weight"])
    assert torch.equal(tail.pop(names[0]), state[names[2]])  # its layer 0 is layer 2
    assert names[3] not in StageState(dict(state), config, first)
    tied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert "model.embed_tokens.weight" in StageState(tied, config, last)  # the tied LM head
    with pytest.raises(InvalidRequestError, match="exceeds the model's 4 layers"):
        TensorShard(0, 1, stage=0, stages=5).local_config(config)
