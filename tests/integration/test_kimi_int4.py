"""Kimi K2's native INT4: a DeepSeek-V3 checkpoint whose routed experts are compressed-tensors
pack-quantized W4A16 (group 32) loads them straight into the INT4 linear under `--weights
int4` while attention, shared experts, the dense layer and the LM head stay dense; its logits
equal a bf16 model built from the dequantized weights within bf16 tolerance, and the fp32
model (experts dequantized exactly) equals transformers on compressed-tensors' dequantization."""

from __future__ import annotations

import pytest
import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.core.engine import Engine
from kvmesh.engine.layers.linear import DenseLinear
from kvmesh.engine.quant.int4 import Int4Linear
from kvmesh_apps.tools.tiny_configs import TinySpec
from kvmesh_apps.tools.tiny_models import make_tiny_model

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return make_tiny_model(
        TinySpec("deepseek_v3", quantize="int4-experts"), tmp_path_factory.mktemp("kimi") / "int4"
    ).path


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig.of(model=str(path), num_pages=64, **kw))


def _prompt() -> list[int]:
    return torch.randint(3, 500, (45,), generator=torch.Generator().manual_seed(1)).tolist()


def test_routed_experts_load_as_int4_and_the_rest_stays_dense(kimi):
    int4 = _engine(kimi, dtype="bf16", weights="int4")
    bf16 = _engine(kimi, dtype="bf16", weights="bf16")
    model = int4.runner.model
    moe = model.layers[1].mlp
    assert all(
        isinstance(e.gate_up, Int4Linear) and isinstance(e.down, Int4Linear) for e in moe.experts
    )
    assert isinstance(moe.shared.gate_up, DenseLinear)
    assert isinstance(model.layers[0].mlp.gate_up, DenseLinear)  # the dense first layer
    assert all(isinstance(p, DenseLinear) for p in model.layers[1].attention.proj.values())
    assert isinstance(model.lm_head, torch.Tensor)
    assert model.weight_bytes < 0.85 * bf16.runner.model.weight_bytes
    ours, reference = int4.score(_prompt()), bf16.score(_prompt())
    torch.testing.assert_close(ours, reference, atol=0.1, rtol=0)  # measured 0.047
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95


def _dequantized_copy(kimi, target):
    """The checkpoint with every packed expert dequantized in fp32 by compressed-tensors' own
    unpack + dequantize, saved as a plain (unquantized) checkpoint."""
    import json
    import shutil

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file, save_file

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    tensors = load_file(str(kimi / "model.safetensors"))
    plain = {n: t for n, t in tensors.items() if not n.endswith(("_packed", "_scale", "_shape"))}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name.removesuffix("_packed")
        shape = torch.Size(tensors[f"{base}_shape"].tolist())
        values = unpack_from_int32(tensors[name], 4, shape)
        plain[base] = dequantize(x_q=values, scale=tensors[f"{base}_scale"].float(), args=args)
    target.mkdir()
    save_file(plain, str(target / "model.safetensors"), metadata={"format": "pt"})
    for file in kimi.iterdir():
        if file.suffix == ".json" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    config = json.loads((kimi / "config.json").read_text())
    config.pop("quantization_config")
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_fp32_model_equals_transformers_on_compressed_tensors_dequantization(kimi, tmp_path):
    from tests.integration.arch_harness import reference_logits, reference_model

    ours = _engine(kimi, dtype="fp32").score(_prompt())
    hf = reference_model(_dequantized_copy(kimi, tmp_path / "plain"))
    torch.testing.assert_close(ours, reference_logits(hf, _prompt()), atol=1e-4, rtol=0)


def test_bf16_prefill_hands_its_latent_pages_to_an_int4_decode(kimi):
    """The mesh's hand-over in one process (bench weights' split_greedy): a bf16-weights
    prefill computes the prompt's BF16 latent pages and first token, an INT4-experts decode
    engine takes the pages and tags and continues -- as `kvmesh up --prefill-weights bf16
    --decode-weights int4` does. The first token is the prefill's; the rest follow the bf16
    run's closely (INT4 experts: at least half of the 32 tokens agree)."""
    from kvmesh_apps.benchmarks.weights_quality import split_greedy

    prefill = _engine(kimi, dtype="bf16", weights="bf16", kv_dtype="bf16")
    decode = _engine(kimi, dtype="bf16", weights="int4", kv_dtype="bf16")
    prompts = [_prompt(), _prompt()[:30]]
    split = split_greedy(prefill, decode, prompts, 16)
    alone = split_greedy(prefill, prefill, prompts, 16)  # bf16 throughout
    assert all(len(s) == 16 for s in split)
    agree = sum(
        a == b for s, r in zip(split, alone, strict=True) for a, b in zip(s, r, strict=True)
    )
    assert split[0][0] == alone[0][0] and agree >= 16, (split, alone)
    assert decode.block_manager.num_used_pages == 0 and prefill.block_manager.num_used_pages == 0
