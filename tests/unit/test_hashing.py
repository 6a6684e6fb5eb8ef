"""Page hashes: deterministic, chained, salted, little-endian, full pages only."""

from __future__ import annotations

import struct

import pytest
import xxhash

from kvmesh.engine.kv.hashing import HASH_SEED, BlockHasher, hash_page, salt_root


def _hashes(tokens: list[int], page_size: int = 4, root: int = 7) -> list[int]:
    out: list[int] = []
    BlockHasher(page_size, root).extend(tokens, out)
    return out


def test_seed_is_fixed() -> None:
    assert HASH_SEED == 0x6B766D657368


def test_hash_page_matches_formula_and_pinned_value() -> None:
    data = struct.pack("<Q", 0) + struct.pack("<4I", 1, 2, 3, 4)
    expected = xxhash.xxh3_64_intdigest(data, seed=0x6B766D657368)
    assert hash_page(0, [1, 2, 3, 4]) == expected
    assert hash_page(0, [1, 2, 3, 4]) == 7101944433564023915


def test_hash_page_uses_parent_little_endian() -> None:
    parent = 0x0102030405060708
    data = parent.to_bytes(8, "little") + struct.pack("<2I", 70000, 2**32 - 1)
    assert hash_page(parent, [70000, 2**32 - 1]) == xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def test_deterministic() -> None:
    tokens = list(range(100, 120))
    assert _hashes(tokens) == _hashes(list(tokens))
    assert len(_hashes(tokens)) == 5


def test_chain_dependence() -> None:
    a = list(range(12))
    b = [99] + a[1:]
    ha, hb = _hashes(a), _hashes(b)
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # page 0 differs -> all differ
    c = a[:4] + [99] + a[5:]
    hc = _hashes(c)
    assert hc[0] == ha[0] and hc[1] != ha[1] and hc[2] != ha[2]


def test_same_page_content_differs_by_position() -> None:
    hashes = _hashes([5, 5, 5, 5, 5, 5, 5, 5])
    assert hashes[0] != hashes[1]


def test_chain_links_parent() -> None:
    hashes = _hashes(list(range(8)), root=11)
    assert hashes[0] == hash_page(11, [0, 1, 2, 3])
    assert hashes[1] == hash_page(hashes[0], [4, 5, 6, 7])


def test_salts_differ() -> None:
    base = salt_root("m", 16, "bf16")
    assert base == salt_root("m", 16, "bf16")
    assert base == 2050268556021096494
    others = {
        salt_root("other", 16, "bf16"),
        salt_root("m", 32, "bf16"),
        salt_root("m", 16, "fp8"),
        salt_root("m", 16, "bf16", tenant="acme"),
    }
    assert base not in others and len(others) == 4
    assert _hashes([1, 2, 3, 4], root=base) != _hashes(
        [1, 2, 3, 4], root=salt_root("x", 16, "bf16")
    )


def test_salt_fields_do_not_run_together() -> None:
    assert salt_root("ab", 16, "c") != salt_root("a", 16, "bc")


def test_partial_pages_not_hashed_and_extend_is_incremental() -> None:
    tokens = list(range(7))
    hashes = _hashes(tokens)
    assert len(hashes) == 1
    hasher = BlockHasher(4, 7)
    hasher.extend(tokens, hashes)
    assert len(hashes) == 1  # nothing new: page 1 is still partial
    tokens.append(7)
    hasher.extend(tokens, hashes)
    assert hashes == _hashes(list(range(8)))


def test_hasher_validates() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0, 1)
    with pytest.raises(ValueError):
        BlockHasher(4, -1)
