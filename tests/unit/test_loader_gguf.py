"""GGUF loading: llama.cpp's q/k permutation undone, the real model's metadata, tensor names, bad
and truncated files, quantized tensors dequantized exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.engine.loader.gguf_loader import gguf_metadata, hf_name, load_gguf, open_gguf, unpermute
from kvmesh.engine.loader.hf_config import config_from_gguf
from kvmesh.errors import ModelFormatError
from tests.unit.tiny_checkpoints import llama_cpp_permute, tiny_hf_weights, write_tiny_gguf


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
