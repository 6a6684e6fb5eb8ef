"""INT4 weight-only linear layers: quantization, GGUF Q4 blocks taken over exactly, and the CPU
kernel against the dequantized reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight


def _weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [32, 64])
def test_round_to_nearest_error_is_within_half_a_step(group):
    w = _weight()
    q = Int4Weight.quantize(w, group, search=False)
    step = q.scale.repeat_interleave(group, dim=1)
    assert q.q.max() <= 15 and q.shape == (96, 128)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64])
def test_scale_search_beats_min_max_in_every_group(group):
    w = _weight(seed=4)
    errors = []
    for search in (False, True):
        diff = Int4Weight.quantize(w, group, search=search).dequantize() - w
        errors.append(diff.view(96, -1, group).square().sum(-1))
    assert (errors[1] <= errors[0] + 1e-9).all()
    assert errors[1].sum() < 0.9 * errors[0].sum()  # clipping outliers pays on gaussian weights


def test_weights_already_on_an_int4_grid_come_back_unchanged():
    exact = Int4Weight.quantize(_weight(seed=5), 32, search=False).dequantize()
    again = Int4Weight.quantize(exact, 32).dequantize()
    torch.testing.assert_close(again, exact, atol=1e-6, rtol=0)
    assert not torch.allclose(Int4Weight.quantize(exact, 64).dequantize(), exact, atol=1e-4)


def test_group_must_divide_the_inputs():
    with pytest.raises(ValueError, match="multiple of the group size"):
        Int4Weight.quantize(_weight(k=96), 64)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_blocks_are_taken_over_exactly(qtype):
    import gguf

    w = _weight(n=8, k=64).numpy()
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w, kind)
    reference = gguf.quants.dequantize(raw, kind).reshape(8, 64)
    ours = Int4Weight.from_gguf_blocks(raw, qtype, 8, 64)
    np.testing.assert_allclose(ours.dequantize().numpy(), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 5, 40])  # 3 x batch rows: each path of Int4Linear
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int4_linear_matches_the_dequantized_reference(dtype, tolerance, batch):
    q = Int4Weight.cat([Int4Weight.quantize(_weight(seed=s), 32) for s in (1, 2)])  # fused rows
    layer = Int4Linear(q, dtype)
    x = torch.randn(3, batch, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = x.float() @ q.dequantize().t()
    got = layer(x).float()
    assert got.shape == (3, batch, 192)
    assert ((got - want).abs().max() / want.abs().max()).item() < tolerance
    element = torch.tensor([], dtype=dtype).element_size()
    assert layer.nbytes == 192 * 128 // 2 + (128 // 32) * 192 * 2 * element  # nibbles + (s, z)


def test_reordering_rows_moves_scales_with_them():
    q = Int4Weight.quantize(_weight(), 32)
    order = torch.arange(95, -1, -1)
    assert torch.equal(q.rows(order).dequantize(), q.dequantize()[order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_back_from_the_packed_kernel_layout(dtype):
    q = Int4Weight.quantize(_weight(n=256, k=128, seed=6), 32)
    layer = Int4Linear(q, dtype)
    if not layer.can_read_rows:
        pytest.skip("this CPU's int4 packing is not the blocked layout rows() reads")
    scale, zero = (t.to(dtype).float() for t in (q.scale, q.zero))  # as the kernel holds them
    values = q.q.float().view(256, 4, 32)
    want = ((values - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(256, 128).to(dtype)
    assert torch.equal(layer.rows(torch.arange(256)), want)
    ids = torch.tensor([255, 0, 33, 31, 32, 64, 33])
    assert torch.equal(layer.rows(ids), want[ids])
    assert torch.equal(layer.dense(), want)


def test_rows_need_the_known_layout():
    layer = Int4Linear(Int4Weight.quantize(_weight(n=48, k=64), 32), torch.float32)
    assert not layer.can_read_rows  # 48 rows are not whole blocks of this layout
    with pytest.raises(ValueError, match="packed layout"):
        layer.rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="packed layout"):
        layer.dense()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_int4_linear_matches_the_dequantized_reference():
    from kvmesh.engine.platform import resolve

    q = Int4Weight.quantize(_weight(n=256, k=256, seed=7), 64)
    layer = resolve("cuda").int4_linear(q, torch.bfloat16)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    want = x.float() @ q.dequantize().to("cuda").t()
    got = layer(x).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


def test_int4_scheme_is_validated_and_only_applies_to_int4_weights():
    from kvmesh.config import EngineConfig, Int4Scheme
    from kvmesh.errors import InvalidRequestError

    assert EngineConfig.of(model="m", weights="bf16", int4_group_size=64).int4 is None
    scheme = EngineConfig.of(model="m", weights="int4", int4_group_size=64, int4_embeddings=True)
    assert scheme.int4 == Int4Scheme(group=64, embeddings=True)
    with pytest.raises(InvalidRequestError, match="int4_group_size"):
        EngineConfig.of(model="m", weights="int4", int4_group_size=48)


def test_int4_flags_reach_the_workers_of_kvmesh_up():
    from kvmesh.cli_args import build_parser
    from kvmesh.mesh.up_config import up_workers

    parser = build_parser()
    up = parser.parse_args(
        ["up", "--weights", "int4", "--int4-group-size", "64", "--int4-embeddings", "on"]
    )
    load = up_workers(up)["decode"].engine.load
    assert (load.weights, load.int4_group_size, load.int4_embeddings) == ("int4", 64, True)
    auto = parser.parse_args(["serve", "decode", "--etcd", "127.0.0.1:1", "--weights", "int4"])
    assert auto.int4_group_size == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--int4-group-size", "48"])


def _tiny_model(embed, embeddings: bool, group: int = 0):
    from kvmesh.config import Int4Scheme
    from kvmesh.engine.config import ModelConfig
    from kvmesh.engine.models.llama import LlamaModel

    config = ModelConfig(
        "llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    p = "model.layers.0."
    shapes = {
        "self_attn.q_proj": (64, 64),
        "self_attn.k_proj": (32, 64),
        "self_attn.v_proj": (32, 64),
        "self_attn.o_proj": (64, 64),
        "mlp.gate_proj": (64, 64),
        "mlp.up_proj": (64, 64),
        "mlp.down_proj": (64, 64),
    }
    weights = {p + n + ".weight": _weight(*s, seed=i) for i, (n, s) in enumerate(shapes.items())}
    weights |= {
        p + "input_layernorm.weight": torch.ones(64),
        p + "post_attention_layernorm.weight": torch.ones(64),
        "model.norm.weight": torch.ones(64),
        "model.embed_tokens.weight": embed,
    }
    return LlamaModel(config, weights, torch.float32, 64, Int4Scheme(group, embeddings))


def test_an_int4_source_table_is_dequantized_when_kept_dense_and_shared_when_int4():
    table = Int4Weight.quantize(_weight(n=128, k=64, seed=9), 32)  # e.g. a GGUF's Q4_0 token_embd
    dense = _tiny_model(table, embeddings=False)
    assert isinstance(dense.embed, torch.Tensor) and dense.lm_head is dense.embed
    assert torch.equal(dense.embed, table.dequantize())
    packed = _tiny_model(table, embeddings=True)
    assert isinstance(packed.embed, Int4Linear) and packed.lm_head is packed.embed
    ids = torch.tensor([5, 127, 0])  # (the model refuses a table whose rows it cannot read)
    assert torch.equal(packed.token_embeddings(ids), table.dequantize()[ids])
    assert packed.weight_bytes < dense.weight_bytes


@pytest.mark.parametrize(
    ("dtype", "weights", "compute"),
    [
        ("auto", "auto", "fp32"),
        ("auto", "int4", "bf16"),
        ("fp32", "int4", "fp32"),
        ("fp32", "bf16", "bf16"),
        ("bf16", "auto", "bf16"),
        ("auto", "fp32", "fp32"),
    ],
)
def test_compute_dtype_follows_weights_when_dtype_is_auto(dtype, weights, compute):
    from kvmesh.config import EngineConfig

    config = EngineConfig.of(model="m", dtype=dtype, weights=weights)
    assert config.compute_dtype == compute and config.resolved_kv_dtype == compute


@pytest.mark.parametrize(
    ("flags", "kv"),
    [
        ((), "fp32"),
        (("--weights", "bf16"), "bf16"),
        (("--weights", "int4"), "bf16"),
        (("--weights", "int4", "--dtype", "fp32"), "fp32"),
    ],
)
def test_the_kv_store_is_told_the_workers_kv_layout(flags, kv):
    """Each worker registers the KV dtype it resolved; a KV store adopts it (test_kvstore)."""
    from kvmesh.mesh.up_config import worker_configs

    for worker in worker_configs(*flags).values():
        assert worker.engine.resolved_kv_dtype == kv


def test_a_group_that_does_not_divide_the_inputs_is_a_model_format_error():
    from kvmesh.errors import ModelFormatError

    table = Int4Weight.quantize(_weight(n=128, k=64, seed=9), 32)  # INT4 source: regrouped
    with pytest.raises(ModelFormatError, match="multiple of the group size 128"):
        _tiny_model(table, embeddings=True, group=128)


def test_kvmesh_up_prefills_short_prompts_on_decode_unless_the_roles_differ_in_precision():
    from kvmesh.cli_args import build_parser
    from kvmesh.mesh.up_config import up_workers
    from kvmesh.routing import UP_LOCAL_PREFILL_TOKENS

    parser = build_parser()

    def worker_value(*up_flags: str) -> int:
        decode = up_workers(parser.parse_args(["up", *up_flags]))["decode"]
        return decode.serving.local_prefill_tokens

    assert worker_value() == UP_LOCAL_PREFILL_TOKENS > 0
    assert worker_value("--decode-weights", "int4") == 0  # prompts get the prefill's precision
    assert worker_value("--local-prefill-tokens", "7") == 7
    alone = parser.parse_args(["serve", "decode", "--etcd", "127.0.0.1:1"])
    assert alone.local_prefill_tokens == 0  # a worker started on its own: always P/D
