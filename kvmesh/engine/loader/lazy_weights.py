"""A state dict that reads each tensor from its file when asked for, and keeps none of them.

The loaders return a `LazyWeights` instead of a dict: `weights[name]` reads that one tensor
now (reading it twice gives two equal tensors); `pop(name)` reads it and forgets the name;
`name in weights`, `len`, iteration and `keys()` read nothing. What the caller drops is freed,
so a model that converts and fuses tensors one by one holds its own form of the weights plus
the few raw tensors it is working on -- never the whole state dict twice.

Files are read with pread into fresh buffers, not mapped: a mapped file's pages that a process
has touched stay in its RSS for as long as the mapping lives (a model keeping one tensor of a
shard would keep the whole shard's touched pages counted), while a read leaves only the copy
the caller holds. The file handles stay open until `close()` (or until the mapping is
garbage-collected).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvmesh.engine.loader.memory import release_freed_memory
from kvmesh.errors import ModelFormatError

if TYPE_CHECKING:
    import torch

# dtype (None: the file's own) -> a tensor in that dtype, or an Int4Weight as stored.
Reader = Callable[["torch.dtype | None"], Any]
# (dim, start, length, dtype) -> that part of a dense tensor, read without the rest
Slicer = Callable[[int, int, int, "torch.dtype | None"], Any]


class Closable(Protocol):
    def close(self) -> None: ...


class LazyWeights(Mapping[str, Any]):
    """HF names -> tensors (or `Int4Weight`s), each read from its file on access."""

    def __init__(
        self,
        readers: Mapping[str, Reader],
        files: Sequence[Closable] = (),
        slicers: Mapping[str, Slicer] | None = None,
    ) -> None:
        """slicers: the names whose parts can be read alone (safetensors files)."""
        self._readers = dict(readers)
        self._slicers = dict(slicers or {})
        self._source: LazyWeights | None = None  # a derived mapping keeps its source's files
        self._open = [True]
        self._close = weakref.finalize(self, _close_all, list(files), self._open)

    @classmethod
    def of(cls, weights: Mapping[str, Any]) -> LazyWeights:
        """`weights` as a LazyWeights (itself if it is one; a dict's values are served as
        they are, converted to a dtype on request)."""
        if isinstance(weights, LazyWeights):
            return weights
        return cls({name: _fixed(weights, name) for name in weights})

    def read(self, name: str, dtype: torch.dtype | None = None) -> Any:
        """The tensor `name`, read now. With `dtype`, a dense tensor comes converted to it
        (bit-identical to `.to(dtype)`; large ones converted in row chunks, so no full-size
        copy in the file's dtype is made); an `Int4Weight` comes as it is."""
        if name not in self._readers:
            raise KeyError(name)
        if not self._open[0]:
            raise ValueError(f"read of {name!r} from closed weights")
        release_freed_memory()  # what the caller freed converting the last one (see memory)
        return self._readers[name](dtype)

    def __getitem__(self, name: str) -> Any:
        return self.read(name)

    def pop_slice(
        self, name: str, dim: int, start: int, length: int, dtype: torch.dtype | None = None
    ) -> Any:
        """Rows (dim 0) or columns (dim 1) [start, start + length) of `name` (see can_slice),
        reading no more than that (and row chunks); the name forgotten."""
        if not self._open[0]:
            raise ValueError(f"read of {name!r} from closed weights")
        slicer = self._slicers.pop(name)
        release_freed_memory()
        del self._readers[name]
        return slicer(dim, start, length, dtype)

    def can_slice(self, name: str) -> bool:
        """Whether `pop_slice` reads only part of `name` (a dense tensor in a safetensors
        file, not a converted one)."""
        return name in self._slicers

    def pop(self, name: str, *default: Any, dtype: torch.dtype | None = None) -> Any:
        """The tensor `name`, read now (as `read`), and the name forgotten (`default` if
        absent)."""
        if name not in self._readers and default:
            return default[0]
        value = self.read(name, dtype)
        del self._readers[name]
        return value

    def __contains__(self, name: object) -> bool:
        return name in self._readers

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._readers))

    def __len__(self) -> int:
        return len(self._readers)

    def derive(self, readers: Mapping[str, Reader]) -> LazyWeights:
        """Another mapping over this one's files (its readers usually read from this one):
        closing either closes both."""
        derived = LazyWeights(readers)
        derived._open, derived._close = self._open, self._close
        derived._source = self
        return derived

    def close(self) -> None:
        """Closes the files; reading afterwards raises ValueError."""
        self._close()

    @property
    def closed(self) -> bool:
        return not self._open[0]

    def __enter__(self) -> LazyWeights:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<LazyWeights {len(self)} tensors, {state}>"


class ReadOnlyFile:
    """An open file descriptor whose byte ranges are read into caller-owned buffers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self._fd).st_size

    def read_into(self, buffer: Any, offset: int) -> None:
        """Fills the writable, contiguous `buffer` from `offset` (ModelFormatError if the file
        ends first)."""
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise ModelFormatError(
                    f"{self.path} ends at byte {offset + done}, inside data that should run "
                    f"to byte {offset + len(view)} (a truncated file)"
                )
            done += got

    def read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(buffer, offset)
        return bytes(buffer)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def as_dtype(tensor: Any, dtype: torch.dtype | None) -> Any:
    """`tensor` in `dtype` (None, or an Int4Weight: as it is)."""
    import torch

    if dtype is None or not isinstance(tensor, torch.Tensor) or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def _fixed(weights: Mapping[str, Any], name: str) -> Reader:
    return lambda dtype: as_dtype(weights[name], dtype)


def _close_all(files: list[Closable], is_open: list[bool]) -> None:
    is_open[0] = False
    for file in files:
        file.close()
