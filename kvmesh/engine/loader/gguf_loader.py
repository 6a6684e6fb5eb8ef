"""Read a GGUF file into a ModelConfig and an HF-named float state dict.

llama.cpp's converter permutes the rows of Q and K for its rotary layout; we undo it
so the weights match HF's rotate-half convention.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.hf_config import config_from_gguf
from kvmesh.errors import ModelFormatError

if TYPE_CHECKING:
    import torch

SUPPORTED_TYPES = {
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueError/struct errors
        raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name.endswith(
            ("tokens", "merges", "token_type", "scores")
        ):
            continue
        try:
            meta[name] = field.contents()
        except Exception:  # noqa: S112 - a field we cannot decode is simply not metadata we use
            continue
    return meta


def load_gguf(path: Path, int4: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """HF-named float tensors; with int4, Q4_0 / Q4_1 matrices come back as `Int4Weight`s taken
    over without dequantizing (llama.cpp's Q/K row permutation undone on the integer rows)."""
    import torch

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    vocab = (
        len(reader.fields["tokenizer.ggml.tokens"].data)
        if "tokenizer.ggml.tokens" in reader.fields
        else 0
    )
    config = config_from_gguf(meta, vocab)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if int4 and tensor.tensor_type.name in ("Q4_0", "Q4_1") and len(tensor.shape) == 2:
            weights[name] = _int4(tensor, name, config)
            continue
        array = _dequantize(tensor)
        if name.endswith(("q_proj.weight", "q_proj.bias")) and config.architecture == "llama":
            array = unpermute(array, config.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")) and config.architecture == "llama":
            array = unpermute(array, config.num_kv_heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        weights[name] = torch.from_numpy(array if array.flags.writeable else array.copy())
    if "lm_head.weight" in weights:
        config = _replace(config, tie_word_embeddings=False)
    return config, weights


def _int4(tensor: Any, name: str, config: ModelConfig) -> Any:
    import torch

    from kvmesh.engine.quant.int4 import Int4Weight

    cols, rows = (int(d) for d in tensor.shape)
    weight = Int4Weight.from_gguf_blocks(tensor.data, tensor.tensor_type.name, rows, cols)
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    part = name.split(".")[-2]
    if part in heads and config.architecture == "llama":
        order = unpermute(np.arange(rows)[:, None], heads[part])[:, 0]
        weight = weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
    return weight


def hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK.match(name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise ModelFormatError(f"unexpected GGUF tensor {name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _dequantize(tensor: Any) -> np.ndarray:
    import gguf

    qtype = tensor.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
        raise ModelFormatError(f"GGUF tensor {tensor.name} has unsupported type {qtype}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(array, dtype=np.float32).reshape(shape)
    except Exception as exc:
        raise ModelFormatError(f"GGUF tensor {tensor.name} is corrupt: {exc}") from exc


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, 2, d/2) back to HF's (head, d/2, 2) order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _replace(config: ModelConfig, **changes: Any) -> ModelConfig:
    from dataclasses import replace

    return replace(config, **changes)
