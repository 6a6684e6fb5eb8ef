"""Chained page hashes that are identical on every node (XXH3-64, fixed seed, little-endian u32).

The hash of page i covers its tokens and the hash of page i - 1, so equal hashes mean equal
prefixes. The chain starts at a root salted by model, page size, KV dtype and tenant.
"""

from __future__ import annotations

import functools
import json
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

HASH_SEED = 0x6B766D657368  # "kvmesh"
_SALT_VERSION = "kvmesh/hash/v1"
_U32 = next(code for code in ("I", "L") if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"


def salt_root(model: str, page_size: int, kv_dtype: str, tenant: str = "") -> int:
    """The chain root: XXH3-64 of a canonical utf-8 encoding of the salt fields."""
    canonical = json.dumps(
        [_SALT_VERSION, model, int(page_size), kv_dtype, tenant],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return xxhash.xxh3_64_intdigest(canonical.encode("utf-8"), seed=HASH_SEED)


def hash_page(parent: int, token_ids: Iterable[int]) -> int:
    """Hash one page: XXH3-64 over the parent (u64 LE) then the token ids (u32 LE each)."""
    tokens = array(_U32, token_ids)
    if _BIG_ENDIAN:
        tokens.byteswap()
    data = parent.to_bytes(8, "little") + tokens.tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


@dataclass(frozen=True)
class BlockHasher:
    """Extends a sequence's list of full-page hashes; partial pages are never hashed."""

    page_size: int
    root: int
    model: str = ""  # with kv_dtype: what `for_tenant` salts a tenant's root with
    kv_dtype: str = ""

    @classmethod
    def salted(cls, model: str, page_size: int, kv_dtype: str, tenant: str = "") -> BlockHasher:
        return cls(page_size, salt_root(model, page_size, kv_dtype, tenant), model, kv_dtype)

    def for_tenant(self, tenant: str) -> BlockHasher:
        """The hasher of another cache salt: tenants never share pages unless they share it."""
        if not tenant:
            return self
        return _tenant_hasher(self.model, self.page_size, self.kv_dtype, tenant)

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if not 0 <= self.root < 2**64:
            raise ValueError(f"root must be an unsigned 64-bit integer, got {self.root!r}")

    def extend(self, token_ids: Sequence[int], hashes: list[int]) -> None:
        """Append to `hashes` the hash of every full page of `token_ids` not yet hashed."""
        size = self.page_size
        parent = hashes[-1] if hashes else self.root
        for page in range(len(hashes), len(token_ids) // size):
            parent = hash_page(parent, token_ids[page * size : (page + 1) * size])
            hashes.append(parent)


@functools.lru_cache(maxsize=1024)
def _tenant_hasher(model: str, page_size: int, kv_dtype: str, tenant: str) -> BlockHasher:
    return BlockHasher.salted(model, page_size, kv_dtype, tenant)
