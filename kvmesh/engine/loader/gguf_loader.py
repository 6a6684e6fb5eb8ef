"""Read a GGUF file into a ModelConfig and HF-named float tensors, one at a time.

llama.cpp's converter permutes the rows of Q and K for its rotary layout; we undo it
so the weights match HF's rotate-half convention.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader.gguf_header import TensorInfo, read_header
from kvmesh.engine.loader.hf_config import config_from_gguf
from kvmesh.engine.loader.lazy_weights import LazyWeights, ReadOnlyFile, as_dtype
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
    """The gguf package's reader (for tools and tests: the loader parses the header with
    gguf_header, much faster and without the reader's many objects)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueError/struct errors
        raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """A reader's metadata as gguf_header gives it: every field but the tokenizer's arrays."""
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


def load_gguf(path: Path, int4: bool = False) -> tuple[ModelConfig, LazyWeights]:
    """HF-named float tensors, each read and converted when asked for; with int4, Q4_0 / Q4_1
    matrices come back as `Int4Weight`s taken over without dequantizing (llama.cpp's Q/K row
    permutation undone on the integer rows)."""
    header = read_header(path)
    config = config_from_gguf(header.metadata, header.lengths.get("tokenizer.ggml.tokens", 0))
    for t in header.tensors:
        if t.qtype not in SUPPORTED_TYPES:
            raise ModelFormatError(f"GGUF tensor {t.name} has unsupported type {t.qtype}")
    file = ReadOnlyFile(path)
    readers = {
        hf_name(t.name): functools.partial(_read, file, t, config, int4) for t in header.tensors
    }
    slicers = {
        hf_name(t.name): functools.partial(_read_slice, file, t, config)
        for t in header.tensors
        if len(t.shape) == 2 and not _kept_int4(t, int4)
    }
    if "lm_head.weight" in readers:
        config = _replace(config, tie_word_embeddings=False)
    return config, LazyWeights(readers, [file], slicers)


def _kept_int4(t: TensorInfo, int4: bool) -> bool:
    return int4 and t.qtype in ("Q4_0", "Q4_1") and len(t.shape) == 2


def _read_slice(
    file: ReadOnlyFile,
    t: TensorInfo,
    config: ModelConfig,
    dim: int,
    start: int,
    length: int,
    dtype: Any,
) -> Any:
    """Rows or columns [start, start + length) of a float matrix: the raw (quantized) tensor
    is read whole -- a fraction of the floats -- but only this part is dequantized, row chunks
    at a time. Permuted Q/K rows: a slice of whole heads, unpermuted on its own."""
    import torch

    from kvmesh.engine.loader.safetensors_io import check_part

    check_part(hf_name(t.name), tuple(t.shape), dim, start, length)
    raw = np.empty(t.items, t.item_dtype)
    file.read_into(raw.reshape(-1).view(np.uint8), t.offset)
    rows, cols = t.shape
    keep = range(start, start + length) if dim == 0 else range(rows)
    columns = slice(start, start + length) if dim == 1 else slice(None)
    out = torch.empty(len(keep), length if dim == 1 else cols, dtype=dtype or torch.float32)
    for chunk in _row_chunks((len(keep), cols)):
        first, last = keep.start + chunk.start, min(keep.stop, keep.start + chunk.stop)
        part = _dequantized_rows(raw[first:last], t, (last - first, cols))
        out[first - keep.start : last - keep.start].copy_(torch.from_numpy(part[:, columns]))
    heads = _permuted_heads(hf_name(t.name), config)
    if heads is not None:
        if dim != 0 or rows % heads or start % (rows // heads) or length % (rows // heads):
            raise ModelFormatError(f"{t.name}: a split of permuted rows must keep whole heads")
        n_head = length // (rows // heads)  # unpermute's reshape, in any dtype
        out = out.view(n_head, length // n_head // 2, 2, cols).transpose(1, 2).reshape(out.shape)
    return out


def _read(file: ReadOnlyFile, t: TensorInfo, config: ModelConfig, int4: bool, dtype: Any) -> Any:
    import torch

    raw = np.empty(t.items, t.item_dtype)
    file.read_into(raw.reshape(-1).view(np.uint8), t.offset)
    if int4 and t.qtype in ("Q4_0", "Q4_1") and len(t.shape) == 2:
        return _int4(raw, t, config)
    heads = _permuted_heads(hf_name(t.name), config)
    if heads is None and dtype not in (None, torch.float32) and len(t.shape) > 1:
        return _dequantize_into(raw, t, dtype)  # straight into the dtype, a chunk at a time
    array = _dequantize(raw, t)
    if heads is not None:
        array = unpermute(array, heads)
    array = np.ascontiguousarray(array, dtype=np.float32)
    return as_dtype(torch.from_numpy(array if array.flags.writeable else array.copy()), dtype)


def _permuted_heads(name: str, config: ModelConfig) -> int | None:
    """Heads of a Q/K projection whose rows llama.cpp permuted (None: not permuted)."""
    if config.architecture != "llama":
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_kv_heads
    return None


def _int4(raw: np.ndarray, t: TensorInfo, config: ModelConfig) -> Any:
    import torch

    from kvmesh.engine.quant.int4 import Int4Weight

    rows, cols = t.shape
    weight = Int4Weight.from_gguf_blocks(raw, t.qtype, rows, cols)
    heads = _permuted_heads(hf_name(t.name), config)
    if heads is not None:
        order = unpermute(np.arange(rows)[:, None], heads)[:, 0]
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


def _dequantize(raw: np.ndarray, t: TensorInfo) -> np.ndarray:
    """Float32 values in `t.shape`. Row chunks of a few MB at a time: gguf's dequantizer holds
    every group's output and the result at once (twice the tensor)."""
    if t.qtype == "F32" and raw.dtype == np.float32:
        return raw.reshape(t.shape)
    if len(t.shape) < 2:
        return _dequantized_rows(raw, t, t.shape)
    out = np.empty(t.shape, np.float32)
    for rows in _row_chunks(t.shape):
        out[rows] = _dequantized_rows(raw[rows], t, out[rows].shape)
    return out


def _dequantize_into(raw: np.ndarray, t: TensorInfo, dtype: Any) -> torch.Tensor:
    """`_dequantize(raw, t)` (of a matrix) converted to `dtype`, never all in float32."""
    import torch

    out = torch.empty(t.shape, dtype=dtype)
    for rows in _row_chunks(t.shape):
        out[rows].copy_(torch.from_numpy(_dequantized_rows(raw[rows], t, out[rows].shape)))
    return out


def _row_chunks(shape: tuple[int, ...]) -> list[slice]:
    step = max(1, (4 << 20) // max(1, 4 * math.prod(shape[1:])))
    return [slice(i, i + step) for i in range(0, shape[0], step)]


def _dequantized_rows(raw: np.ndarray, t: TensorInfo, shape: tuple[int, ...]) -> np.ndarray:
    import gguf

    try:
        array = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.qtype])
        return np.asarray(array, dtype=np.float32).reshape(shape)
    except Exception as exc:
        raise ModelFormatError(f"GGUF tensor {t.name} is corrupt: {exc}") from exc


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, 2, d/2) back to HF's (head, d/2, 2) order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _replace(config: ModelConfig, **changes: Any) -> ModelConfig:
    from dataclasses import replace

    return replace(config, **changes)
