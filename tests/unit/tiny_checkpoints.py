"""Tiny checkpoints written by the loader tests (and the lazy-weights and model-cache tests):
a one-layer GGUF in llama.cpp's layout and a sharded safetensors folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `permute` (HF rotate-half rows -> interleaved rows)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


# --- unpermute ------------------------------------------------------------------------------


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
