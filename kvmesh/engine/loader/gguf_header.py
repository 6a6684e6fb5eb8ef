"""A GGUF file's header -- metadata and tensor table -- parsed without the gguf package's
reader, which builds numpy views of every part of every string: seconds, and more memory than
SmolLM2's INT4 weights, for a 49k-token vocabulary. The tokenizer's big arrays are
skipped here (their lengths kept); every other value comes out as `ReaderField.contents()`
gives it (arrays of arrays flattened likewise).

Layout (v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 key count; per key a string
name, u32 type and value; per tensor a string name, u32 n_dims, u64 dims (innermost first),
u32 type, u64 offset into the data section, which starts at the next multiple of
`general.alignment` (32). Strings are a u64 length and UTF-8 bytes. A file written on a host of
the other byte order reads with its numbers swapped.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.errors import ModelFormatError

_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_SKIPPED = ("tokens", "merges", "token_type", "scores")  # of tokenizer.ggml.*: not config
_ITEMS = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-table row: the raw items start at byte `offset` of the file."""

    name: str
    qtype: str  # a gguf.GGMLQuantizationType name
    shape: tuple[int, ...]  # row-major (reversed GGUF dims)
    offset: int
    items: tuple[int, ...]  # the shape of the raw items: elements, or bytes of blocks
    item_dtype: np.dtype


@dataclass(frozen=True)
class GgufHeader:
    metadata: dict[str, Any]  # key -> value, as gguf_metadata(GGUFReader) gives them
    lengths: dict[str, int]  # key -> length of each skipped array (tokenizer.ggml.tokens, ...)
    tensors: list[TensorInfo]


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF at `path` (ModelFormatError if it is not a readable one)."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Parser(data).header()
    except (OSError, ValueError, KeyError, IndexError, struct.error) as exc:
        raise ModelFormatError(f"{path} is not a readable GGUF file: {exc!r}") from exc


class _Parser:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos, self.order = data, 0, "<"

    def header(self) -> GgufHeader:
        if self.data[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        self.pos = 4
        version = self.scalar("I")
        if version & 0xFFFF == 0:  # written on a host of the other byte order
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        tensors, keys = self.scalar("Q"), self.scalar("Q")
        meta = {"GGUF.version": version, "GGUF.tensor_count": tensors, "GGUF.kv_count": keys}
        lengths: dict[str, int] = {}
        types: dict[str, int] = {}
        for _ in range(keys):
            self.field(meta, lengths, types)
        rows = [self.tensor_row() for _ in range(tensors)]
        if len({row[0] for row in rows}) != len(rows):
            raise ValueError("duplicate tensor names")
        align = meta.get("general.alignment", 32)
        if "general.alignment" in meta and (types["general.alignment"] != 4 or align & (align - 1)):
            raise ValueError(f"bad general.alignment {align!r}")
        start = -(-self.pos // align) * align
        return GgufHeader(meta, lengths, [self.tensor(*row, start) for row in rows])

    def field(self, meta: dict[str, Any], lengths: dict[str, int], types: dict[str, int]) -> None:
        key = self.string()
        if key in types:
            raise KeyError(f"duplicate key {key}")
        types[key] = vtype = self.scalar("I")
        if key.startswith("tokenizer.ggml.") and key.endswith(_SKIPPED) and vtype == _ARRAY:
            lengths[key] = self.skip_array()
            return
        value = self.value(vtype)
        with contextlib.suppress(UnicodeDecodeError):  # gguf_metadata drops such a field
            meta[key] = [_text(v) for v in value] if vtype == _ARRAY else _text(value)

    def value(self, vtype: int) -> Any:
        """A scalar, a string's bytes, or a flat list of an array's leaves."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.raw_string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        itype, count = self.scalar("I"), self.scalar("Q")
        items = [self.value(itype) for _ in range(count)]
        return [leaf for item in items for leaf in item] if itype == _ARRAY else items

    def skip_array(self) -> int:
        itype, count = self.scalar("I"), self.scalar("Q")
        if itype in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[itype])
        else:
            for _ in range(count):
                self.skip(itype)
        if self.pos > len(self.data):
            raise ValueError("the metadata runs past the end of the file")
        return count

    def skip(self, vtype: int) -> None:
        if vtype == _STRING:
            length = self.scalar("Q")  # read before pos is: `pos += scalar()` would lose 8
            self.pos += length
        else:
            self.value(vtype)

    def tensor_row(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        dims = tuple(self.scalar("Q") for _ in range(self.scalar("I")))
        return name, dims, self.scalar("I"), self.scalar("Q")

    def tensor(self, name: str, dims: tuple[int, ...], raw: int, offset: int, start: int) -> Any:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(raw)
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        count = math.prod(dims)
        item = _ITEMS.get(qtype.name)
        if item is None and (not shape or shape[-1] % block):
            raise ValueError(f"tensor {name}: {shape} is not made of {qtype.name} blocks")
        items = shape if item is not None else (*shape[:-1], shape[-1] // block * type_size)
        dtype = np.dtype(item or np.uint8).newbyteorder("=" if self.order == "<" else ">")
        if start + offset + count * type_size // block > len(self.data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        return TensorInfo(name, qtype.name, shape, start + offset, items, dtype)

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw_string(self) -> bytes:
        length = self.scalar("Q")
        raw = self.data[self.pos : self.pos + length]
        if len(raw) != length:
            raise ValueError("a string runs past the end of the file")
        self.pos += length
        return raw

    def string(self) -> str:
        return self.raw_string().decode("utf-8")


def _text(value: Any) -> Any:
    return value.decode("utf-8") if isinstance(value, bytes) else value
