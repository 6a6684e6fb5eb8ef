"""compressed-tensors pack-quantized INT4 read into Int4Weight: bit-exact against the library's
own quantize / pack / unpack / dequantize, its name-matching rules, and the configs we refuse."""

from __future__ import annotations

import copy

import pytest
import torch

from kvmesh.engine.quant.compressed_tensors import (
    CompressedTensorsScheme,
    is_pack_quantized,
    read_pack_quantized,
)
from kvmesh.errors import ModelFormatError

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import (  # noqa: E402
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from compressed_tensors.utils.match import is_match  # noqa: E402

PREFIX = "model.layers.3.mlp.experts.17.down_proj"
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
KIMI_CONFIG = {  # Kimi K2 Thinking's config.json (written by an older compressed-tensors)
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": KIMI_IGNORE,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
}


def _args(group: int) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group
    )


def _pack(w: torch.Tensor, group: int, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors' own scales, quantization and int32 packing of w."""
    args = _args(group)
    groups = w.unflatten(-1, (-1, group))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scale = scale.to(scale_dtype)
    values = quantize(x=w, scale=scale, zero_point=zero, args=args, dtype=torch.int8)
    return {
        f"{PREFIX}.weight_packed": pack_to_int32(values, 4),
        f"{PREFIX}.weight_scale": scale,
        f"{PREFIX}.weight_shape": torch.tensor(w.shape, dtype=torch.int32),
    }


def _weight(rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [32, 128])
def test_values_and_dequantized_weight_equal_compressed_tensors_exactly(group, scale_dtype):
    tensors = _pack(_weight(), group, scale_dtype)
    packed, scale, shape = (
        tensors[f"{PREFIX}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")
    )
    values = unpack_from_int32(packed, 4, shape)  # int8 in -8..7
    theirs = dequantize(x_q=values, scale=scale.float(), args=_args(group))
    ours = read_pack_quantized(dict(tensors), PREFIX, CompressedTensorsScheme(group))
    assert ours.group == group and ours.q.dtype == torch.uint8
    assert torch.equal(ours.q.to(torch.int16) - 8, values.to(torch.int16))
    assert torch.equal(ours.scale, scale.float()) and not ours.zero.any()
    assert ours.dequantize().dtype == theirs.dtype == torch.float32
    assert torch.equal(ours.dequantize(), theirs)
    decompressed = PackedQuantizationCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale.float(), "weight_shape": shape},
        ct.quantization.QuantizationScheme(targets=["Linear"], weights=_args(group)),
    )["weight"]
    assert torch.equal(ours.dequantize(), decompressed)


def test_the_library_compressor_output_reads_too():
    scheme = ct.quantization.QuantizationScheme(targets=["Linear"], weights=_args(32))
    w = _weight(seed=3)
    groups = w.unflatten(-1, (-1, 32))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    compressed = PackedQuantizationCompressor.compress(state, scheme)  # weight_shape int64
    assert set(compressed) == {"weight_packed", "weight_scale", "weight_shape"}
    tensors = {f"{PREFIX}.{name}": t for name, t in compressed.items()}
    ours = read_pack_quantized(tensors, PREFIX, CompressedTensorsScheme(32))
    theirs = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
    assert torch.equal(ours.dequantize(), theirs)


class _Lazy:
    """Only the three operations the reader may use."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def pop(self, name: str) -> torch.Tensor:
        return self._tensors.pop(name)


def test_reading_pops_the_three_tensors_from_a_lazy_mapping():
    tensors = {**_pack(_weight(), 32, torch.bfloat16), "other.weight": torch.ones(2)}
    read_pack_quantized(_Lazy(tensors), PREFIX, CompressedTensorsScheme(32))
    assert list(tensors) == ["other.weight"]


@pytest.mark.parametrize("missing", ["weight_packed", "weight_scale", "weight_shape"])
def test_a_missing_tensor_is_named(missing):
    tensors = _pack(_weight(), 32, torch.bfloat16)
    del tensors[f"{PREFIX}.{missing}"]
    with pytest.raises(ModelFormatError, match=f"{PREFIX}.{missing}"):
        read_pack_quantized(tensors, PREFIX, CompressedTensorsScheme(32))
    assert len(tensors) == 2  # nothing popped


@pytest.mark.parametrize(
    "name, value",
    [
        ("weight_scale", torch.ones(48, 4)),  # groups of 64, not 32
        ("weight_packed", torch.zeros(48, 16, dtype=torch.int32)),
        ("weight_packed", torch.zeros(48, 32, dtype=torch.int64)),
        ("weight_shape", torch.tensor([48, 255], dtype=torch.int32)),
        ("weight_shape", torch.tensor([48.0, 256.0])),
        ("weight_zero_point", torch.zeros(48, 8, dtype=torch.int32)),
    ],
)
def test_inconsistent_tensors_raise(name, value):
    tensors = {**_pack(_weight(), 32, torch.bfloat16), f"{PREFIX}.{name}": value}
    with pytest.raises(ModelFormatError, match=PREFIX):
        read_pack_quantized(tensors, PREFIX, CompressedTensorsScheme(32))


KIMI_NAMES = [
    "lm_head",
    "model.layers.0.self_attn.q_a_proj",
    "model.layers.0.self_attn.q_b_proj",
    "model.layers.0.self_attn.kv_a_proj_with_mqa",
    "model.layers.0.self_attn.kv_b_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.mlp.gate",
    "model.layers.1.mlp.shared_experts.gate_proj",
    "model.layers.1.mlp.shared_experts.down_proj",
    "model.layers.1.mlp.experts.0.gate_proj",
    "model.layers.1.mlp.experts.0.up_proj",
    "model.layers.60.mlp.experts.383.down_proj",
]
SCHEMES = [
    (["Linear"], KIMI_IGNORE),
    (["Linear"], [*KIMI_IGNORE, "re:.*mlp\\.gate$", "model.layers.1.mlp.experts.0.up_proj"]),
    (["re:.*experts.*"], []),
    (["re:experts"], []),  # re.match: anchored at the start, so it matches nothing here
    (["model.layers.1.mlp.experts.0.gate_proj", "re:.*\\.o_proj$"], ["re:model.layers.0.*"]),
    (["Linear"], ["Linear"]),
]


@pytest.mark.parametrize("targets, ignore", SCHEMES)
def test_quantizes_agrees_with_compressed_tensors_matching(targets, ignore):
    scheme = CompressedTensorsScheme(32, tuple(targets), tuple(ignore))
    linear = torch.nn.Linear(1, 1)
    for name in KIMI_NAMES:
        assert scheme.quantizes(name) == is_match(name, linear, targets, ignore), name


def test_kimi_k2_config_quantizes_routed_experts_only():
    scheme = CompressedTensorsScheme.from_config(KIMI_CONFIG)
    assert scheme.group_size == 32 and scheme.targets == ("Linear",)
    quantized = [name for name in KIMI_NAMES if scheme.quantizes(name)]
    assert set(quantized) == {n for n in KIMI_NAMES if ".experts." in n} | {
        "model.layers.1.mlp.gate"  # Kimi's list leaves the router out: it is not a Linear there
    }
    assert is_pack_quantized({"quantization_config": KIMI_CONFIG})


def test_the_library_serialised_config_parses():
    from kvmesh_apps.tools.tiny_int4 import quantization_config

    config = quantization_config()
    scheme = CompressedTensorsScheme.from_config(config)
    assert scheme.group_size == 32 and not scheme.quantizes("model.layers.1.mlp.gate")
    assert is_pack_quantized({"quantization_config": config})


def _bad(path: tuple[str, ...], value) -> dict:
    config = copy.deepcopy(KIMI_CONFIG)
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return config


W = ("config_groups", "group_0", "weights")


@pytest.mark.parametrize(
    "config, named",
    [
        (_bad(("quant_method",), "gptq"), "gptq"),
        (_bad(("format",), "naive-quantized"), "naive-quantized"),
        (_bad(("kv_cache_scheme",), {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (_bad((*W, "num_bits"), 8), "num_bits"),
        (_bad((*W, "symmetric"), False), "symmetric"),
        (_bad((*W, "strategy"), "channel"), "strategy"),
        (_bad((*W, "type"), "float"), "type"),
        (_bad((*W, "actorder"), "group"), "actorder"),
        (_bad((*W, "group_size"), None), "group_size"),
        (_bad(("config_groups", "group_0", "input_activations"), {"num_bits": 8}), "activation"),
        (_bad(("config_groups", "group_0", "targets"), ["Embedding"]), "Embedding"),
        (_bad(("config_groups",), {}), "config_groups"),
    ],
)
def test_unsupported_configs_raise_naming_what(config, named):
    with pytest.raises(ModelFormatError, match=named):
        CompressedTensorsScheme.from_config(config)
    assert is_pack_quantized({"quantization_config": config}) == (
        config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    )


def test_is_pack_quantized_needs_the_method_and_format():
    assert not is_pack_quantized({})
    assert not is_pack_quantized({"quantization_config": {"quant_method": "fp8"}})
    assert is_pack_quantized({"compression_config": KIMI_CONFIG})
