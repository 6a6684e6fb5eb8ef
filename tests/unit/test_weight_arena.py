"""weight_arena.pack: the decoder's linear weights moved into one allocation in the order a
decode step reads them, each a view of it with the same values, and the greedy tokens unchanged."""

from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.layers.linear import DenseLinear
from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight
from kvmesh.engine.runner import weight_arena
from kvmesh_apps.tools.tiny_configs import TinySize, TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model


def _int4(rows: int, cols: int) -> Int4Linear:
    return Int4Linear(Int4Weight.quantize(torch.randn(rows, cols), 32, search=False), torch.float32)


def test_weights_become_views_of_one_allocation_in_stream_order_with_their_values():
    torch.manual_seed(0)
    linears = [
        DenseLinear(torch.randn(96, 64).bfloat16()),
        _int4(128, 64),
        DenseLinear(torch.randn(64, 96).bfloat16(), torch.randn(64).bfloat16()),
    ]
    tensors = [linears[0].weight, linears[1].packed, linears[1].scales_zeros, linears[2].weight]
    before = [t.clone() for t in tensors]
    arena = weight_arena.pack(linears)
    assert arena is not None and arena.data_ptr() % weight_arena.HUGE_PAGE == 0
    after = [linears[0].weight, linears[1].packed, linears[1].scales_zeros, linears[2].weight]
    starts = [t.data_ptr() for t in after]
    assert starts == sorted(starts), "in the order the linears read them"
    assert all(
        arena.data_ptr() <= s and s + t.nbytes <= arena.data_ptr() + arena.numel()
        for s, t in zip(starts, after, strict=True)
    )
    assert all(s % weight_arena.ALIGN == 0 for s in starts)
    for old, new in zip(before, after, strict=True):
        assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old)
    assert linears[2].bias.data_ptr() not in range(
        arena.data_ptr(), arena.data_ptr() + arena.numel()
    )
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linears[0](x), DenseLinear(before[0])(x))  # the same kernel, same bits


def test_nothing_to_pack_leaves_weights_where_they_are():
    assert weight_arena.pack([]) is None
    meta = DenseLinear(torch.empty(4, 4, device="meta"))
    assert weight_arena.pack([meta]) is None and meta.weight.device.type == "meta"


@pytest.mark.skipif(cpu_ops() is None, reason="the fused decode step needs the CPU kernels")
@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_a_fused_engine_decodes_from_its_packed_weights_as_an_unpacked_one(tmp_path, weights):
    spec = TinySpec("llama", size=TinySize(hidden_size=128, intermediate_size=256))
    path = str(make_tiny_model(spec, tmp_path / "m").path)
    prompts = [[5, 9, 31, 7, 100, 42], [17, 3, 250]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    options = dict(dtype="bf16", weights=weights, num_pages=32, max_num_seqs=2)
    eager = LLM(path, decode_step="eager", **options)
    fused = LLM(path, **options)
    arena = fused.engine.runner.fused.arena
    qkv = fused.engine.runner.model.layers[0].attention.qkv
    first = qkv.weight if weights == "bf16" else qkv.packed
    assert arena is not None and first.data_ptr() == arena.data_ptr()
    assert eager.engine.runner.fused is None
    got = [o.token_ids for o in fused.generate_ids(prompts, greedy)]
    assert got == [o.token_ids for o in eager.generate_ids(prompts, greedy)]
