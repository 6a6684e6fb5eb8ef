"""The safetensors file format, read one tensor at a time and written as a stream.

A file is an 8-byte little-endian header length N, N bytes of JSON -- `{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, which may end in spaces --
then the data section the offsets index. Reads go through `ReadOnlyFile` (pread, see
lazy_weights); the writer appends each tensor's bytes as it comes, after room left for the
header, and writes the header last.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvmesh.engine.loader.lazy_weights import ReadOnlyFile, as_dtype
from kvmesh.errors import ModelFormatError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the limit the safetensors library itself enforces
CHUNK_BYTES = 16 << 20  # a dtype-converting read converts this much at a time


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in the file: absolute byte offsets [begin, end)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """An open safetensors file: the header parsed at open (ModelFormatError if it is not one,
    or is truncated), each tensor read when asked for into a fresh tensor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file = ReadOnlyFile(path)
        except OSError as exc:
            raise ModelFormatError(f"{path} is not readable: {exc}") from exc
        try:
            self.entries, self.metadata = _parse_header(self._file)
        except BaseException:
            self._file.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` in its stored dtype, or converted to `dtype` (in row chunks of
        about CHUNK_BYTES when it is larger)."""
        entry = self.entries[name]
        size = entry.end - entry.begin
        if dtype in (None, entry.dtype) or size <= CHUNK_BYTES or not entry.shape[0]:
            return as_dtype(
                self._bytes(entry.begin, size).view(entry.dtype).view(entry.shape), dtype
            )
        out = torch.empty(entry.shape, dtype=dtype)
        rows = entry.shape[0]
        row_bytes = size // rows
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for first in range(0, rows, step):
            last = min(rows, first + step)
            raw = self._bytes(entry.begin + first * row_bytes, (last - first) * row_bytes)
            out[first:last].copy_(raw.view(entry.dtype).view(last - first, *entry.shape[1:]))
        return out

    def read_slice(
        self, name: str, dim: int, start: int, length: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1, of a 2-D tensor) [start, start + length) of `name`,
        reading only those rows, or the rows in chunks of about CHUNK_BYTES whose columns are
        kept: never the whole tensor at once (a tensor-parallel rank's part)."""
        entry = self.entries[name]
        check_part(name, entry.shape, dim, start, length)
        rows = entry.shape[0]
        row_bytes = (entry.end - entry.begin) // rows if rows else 0
        if dim == 0:
            raw = self._bytes(entry.begin + start * row_bytes, length * row_bytes)
            return as_dtype(raw.view(entry.dtype).view(length, *entry.shape[1:]), dtype)
        out = torch.empty(rows, length, dtype=dtype or entry.dtype)
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for first in range(0, rows, step):
            last = min(rows, first + step)
            raw = self._bytes(entry.begin + first * row_bytes, (last - first) * row_bytes)
            chunk = raw.view(entry.dtype).view(last - first, entry.shape[1])
            out[first:last].copy_(chunk[:, start : start + length])
        return out

    def _bytes(self, offset: int, length: int) -> torch.Tensor:
        buffer = torch.empty(length, dtype=torch.uint8)
        self._file.read_into(buffer.numpy(), offset)
        return buffer

    def close(self) -> None:
        self._file.close()


def check_part(name: str, shape: tuple[int, ...], dim: int, start: int, length: int) -> None:
    """ModelFormatError unless [start, start + length) lies inside dimension `dim` (0, or 1 of
    a matrix) of `shape`: a checkpoint smaller than its config says."""
    if dim not in (0, 1) or len(shape) <= dim or (dim == 1 and len(shape) != 2):
        raise ValueError(f"{name}: only rows or the columns of a matrix are read in part")
    if start < 0 or length < 0 or start + length > shape[dim]:
        raise ModelFormatError(
            f"{name} has {shape[dim]} entries in dimension {dim}; a rank "
            f"needs [{start}, {start + length})"
        )


def _parse_header(file: ReadOnlyFile) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    where = f"{file.path} is not a safetensors file"
    if file.size < 8:
        raise ModelFormatError(f"{where}: {file.size} bytes")
    (length,) = struct.unpack("<Q", file.read(0, 8))
    if length > min(file.size - 8, _MAX_HEADER):
        raise ModelFormatError(f"{where}: a header of {length} bytes in {file.size}")
    try:
        header = json.loads(file.read(8, length))
        metadata = header.pop("__metadata__", None) or {}
        entries = {name: _entry(info, 8 + length) for name, info in header.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ModelFormatError(f"{where}: {exc!r}") from exc
    end = max((e.end for e in entries.values()), default=8 + length)
    if end != file.size:
        raise ModelFormatError(f"{where}: its data ends at byte {end}, the file at {file.size}")
    return entries, metadata


def _entry(info: dict[str, Any], data_start: int) -> TensorEntry:
    dtype = DTYPES[info["dtype"]]
    shape = tuple(int(d) for d in info["shape"])
    begin, end = (int(o) for o in info["data_offsets"])
    size = math.prod(shape) * dtype.itemsize
    if min(shape, default=0) < 0 or begin < 0 or end - begin != size:
        raise ValueError(f"offsets {begin}..{end} do not hold {info['dtype']} {list(shape)}")
    return TensorEntry(dtype, shape, data_start + begin, data_start + end)


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor (nothing kept in memory): the data first,
    after `room` bytes left for the header; `finish` writes the header there, padded with
    spaces (moving the data along if the header outgrew the room)."""

    def __init__(self, path: Path, room: int) -> None:
        self.path = path
        self._room = -(-room // 8) * 8  # the data starts 8-aligned, as safetensors' own do
        self._file = path.open("wb")
        self._file.seek(8 + self._room)
        self._entries: dict[str, dict[str, Any]] = {}
        self._size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"tensor {name!r} written twice")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)
        self._entries[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._size, self._size + data.numel()],
        }
        self._size += data.numel()

    def finish(self, metadata: dict[str, str]) -> None:
        text = json.dumps({"__metadata__": metadata, **self._entries}, separators=(",", ":"))
        header = text.encode()
        if len(header) > self._room:
            self._shift_data(-(-len(header) // 8) * 8 - self._room)
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self._room) + header.ljust(self._room, b" "))
        self._file.close()

    def _shift_data(self, by: int) -> None:
        """Moves the data section `by` bytes on, last chunk first (never overwriting bytes
        still to be moved), and grows the header room to match."""
        self._file.flush()
        start, end = 8 + self._room, 8 + self._room + self._size
        with self.path.open("r+b") as f:
            while end > start:
                begin = max(start, end - CHUNK_BYTES)
                f.seek(begin)
                chunk = f.read(end - begin)
                f.seek(begin + by)
                f.write(chunk)
                end = begin
        self._file.seek(8 + self._room + by + self._size)
        self._room += by

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
