"""`kvmesh make-tiny-model`: every architecture's checkpoint loads back into transformers with
the same logits, carries the hub's tensor names, is byte-reproducible; its tokenizer and the
int4-experts variant (read by our compressed-tensors reader); the CLI."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvmesh.errors import InvalidRequestError
from kvmesh_apps.tools.tiny_configs import ARCHS, TinySize, TinySpec
from kvmesh_apps.tools.tiny_models import build_model, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
MOE = ("qwen3_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    out = {arch: make_tiny_model(TinySpec(arch), root / arch).path for arch in ARCHS}
    out["int4"] = make_tiny_model(
        TinySpec("deepseek_v3", quantize="int4-experts"), root / "int4"
    ).path
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_loads_it_back_with_identical_logits(written, arch):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(written[arch]).eval()
    assert type(loaded).__name__ == CLASSES[arch]
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = loaded(ids).logits
        assert torch.equal(logits, build_model(TinySpec(arch))(ids).logits)
    assert logits.shape == (2, 40, _config(written[arch])["vocab_size"]) and logits.std() > 0.3


@pytest.mark.parametrize("arch", list(ARCHS))
def test_weights_are_fp32_and_norms_and_biases_random(written, arch):
    tensors = _tensors(written[arch])
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    norms = [t for name, t in tensors.items() if name.endswith("norm.weight")]
    assert norms and all(not torch.equal(t, torch.ones_like(t)) for t in norms)
    biases = [t for name, t in tensors.items() if name.endswith("e_score_correction_bias")]
    assert all(t.abs().min() > 0 for t in biases) and (len(biases) > 0) == (
        arch in MOE and arch != "qwen3_moe"
    )


@pytest.mark.parametrize("arch", MOE)
def test_experts_carry_the_hub_per_expert_names(written, arch):
    names = set(_tensors(written[arch]))
    assert not [n for n in names if n.endswith(("gate_up_proj", "experts.down_proj"))]
    for layer in range(1, _config(written[arch])["num_hidden_layers"]):
        for e in range(8):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # one dense layer first


def test_config_fields_an_implementation_needs(written):
    ds = _config(written["deepseek_v3"])
    assert (ds["q_lora_rank"], ds["kv_lora_rank"], ds["rope_interleave"]) == (32, 64, True)
    assert (ds["n_group"], ds["topk_group"], ds["first_k_dense_replace"]) == (1, 1, 1)
    assert ds["routed_scaling_factor"] != 1 and ds["num_nextn_predict_layers"] == 0
    assert ds["rope_parameters"]["rope_type"] == "yarn" and ds["rope_parameters"]["mscale"] == 1
    glm = _config(written["glm4_moe"])
    assert glm["rope_parameters"]["partial_rotary_factor"] == 0.5 and glm["attention_bias"]
    assert glm["use_qk_norm"] and glm["head_dim"] * glm["num_attention_heads"] != 64
    lite = _config(written["glm4_moe_lite"])
    assert lite["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert _config(written["glm_moe_dsa"])["index_topk"] == 16
    assert _config(written["qwen3_moe"])["mlp_only_layers"] == [0]


def test_same_seed_same_bytes_other_seed_other_weights(written, tmp_path):
    again = make_tiny_model(TinySpec("deepseek_v3"), tmp_path / "again").path
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(again / name) == _sha(written["deepseek_v3"] / name), name
    other = make_tiny_model(TinySpec("deepseek_v3", seed=1), tmp_path / "other").path
    assert _sha(other / "model.safetensors") != _sha(again / "model.safetensors")


def test_tokenizer_round_trips_and_applies_chatml(written):
    from transformers import AutoTokenizer

    path = written["qwen3"]
    tok = AutoTokenizer.from_pretrained(path)
    text = "Four score and seven years ago — naïve café, 日本語, 🙂!\n\ttabs"
    assert tok.decode(tok(text)["input_ids"]) == text
    config, generation = _config(path), json.loads((path / "generation_config.json").read_text())
    assert len(tok) == config["vocab_size"] and 512 <= len(tok) <= 2048
    assert tok.eos_token == "<|im_end|>" == tok.convert_ids_to_tokens(config["eos_token_id"])
    assert generation["eos_token_id"] == config["eos_token_id"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_start|>user")["input_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


def test_int4_experts_are_exactly_the_pack_quantized_tensors(written):
    from kvmesh.engine.quant.compressed_tensors import CompressedTensorsScheme, read_pack_quantized

    packed, plain = _tensors(written["int4"]), _tensors(written["deepseek_v3"])
    scheme = CompressedTensorsScheme.from_config(_config(written["int4"])["quantization_config"])
    experts = [n[: -len(".weight")] for n in plain if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3
    for prefix in experts:
        w = plain.pop(f"{prefix}.weight")
        out, cols = w.shape
        assert packed[f"{prefix}.weight_packed"].dtype == torch.int32
        assert packed[f"{prefix}.weight_packed"].shape == (out, cols // 8)
        assert packed[f"{prefix}.weight_scale"].dtype == torch.bfloat16
        assert packed[f"{prefix}.weight_scale"].shape == (out, cols // 32)
        assert packed[f"{prefix}.weight_shape"].tolist() == [out, cols]
        assert scheme.quantizes(prefix)
        int4 = read_pack_quantized(packed, prefix, scheme)
        step = int4.scale.repeat_interleave(32, dim=1)  # bf16 scales: the max may clamp, + 1/32
        assert ((int4.dequantize() - w).abs() <= 0.54 * step).all()
    assert packed.keys() == plain.keys()  # the rest is unchanged, and nothing is left over
    assert all(torch.equal(packed[n], plain[n]) for n in plain)
    linears = {n[: -len(".weight")] for n in plain if n.endswith("proj.weight")} | {"lm_head"}
    assert not [n for n in linears if scheme.quantizes(n)]


def test_int4_on_a_dense_arch_is_refused():
    from kvmesh.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="MoE"):
        TinySpec("llama", quantize="int4-experts")
    with pytest.raises(InvalidRequestError, match="heads"):
        TinySize(hidden_size=66)


def test_cli_writes_and_prints_where(written, tmp_path):
    out = tmp_path / "cli"
    argv = ["make-tiny-model", "--arch", "deepseek_v3", "--output", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["path"] == str(out) and result["architecture"] == "DeepseekV3ForCausalLM"
    assert _sha(out / "model.safetensors") == _sha(written["deepseek_v3"] / "model.safetensors")


def test_a_long_context_checkpoint(tmp_path):
    """--max-position-embeddings: agents' prompts (32k-64k tokens) need a longer context;
    Kimi's yarn factor stretches with it."""
    from kvmesh.engine.loader import read_config, resolve_model

    out = tmp_path / "long"
    argv = [
        "make-tiny-model",
        "--arch",
        "deepseek_v3",
        "--output",
        str(out),
        "--max-position-embeddings",
        "65536",
    ]
    subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *argv], cwd=REPO, check=True, capture_output=True
    )
    config = _config(out)
    assert config["max_position_embeddings"] == 65536
    assert config["rope_parameters"]["factor"] == 65536 / 256
    assert read_config(resolve_model(str(out))).max_position_embeddings == 65536
    with pytest.raises(InvalidRequestError, match="at least 256"):
        TinySpec("llama", max_position_embeddings=100)


def test_cli_help_imports_no_torch():
    probe = (
        "import sys, runpy; sys.argv = ['kvmesh', 'make-tiny-model', '--help']\n"
        "try: runpy.run_module('kvmesh.cli', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print([m for m in ('torch', 'transformers', 'numpy') if m in sys.modules])"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert "--quantize" in run.stdout and run.stdout.strip().splitlines()[-1] == "[]"
