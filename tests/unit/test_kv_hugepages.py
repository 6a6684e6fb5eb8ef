"""--kv-hugepages: the KV page pool in a hugetlb memfd. Where the machine has too few 2 MiB
hugepages to give (these CI machines reserve none) the pool is refused with a clear error naming
what to reserve; where it has them, the pool lies on 2 MiB pages. An engine asked for it builds
its pool there and answers as without."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

import kvmesh.engine.core.engine_setup as engine_setup
import kvmesh.engine.parallel.shared_pages as shared_pages
from kvmesh import LLM, SamplingParams
from kvmesh.engine.kv.layout import KVCacheSpec
from kvmesh.engine.parallel.shared_pages import (
    HUGEPAGE,
    new_pool,
    obtainable_hugepages,
    pool_offsets,
    require_hugepages,
)
from kvmesh.errors import HugePagesError

SPEC = KVCacheSpec.gqa(2, 2, 8, 16, "fp32")
PAGES = 64


def _kernel_page_kb(address: int) -> int:
    """The kernel page size of the mapping holding `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                for field in lines[i + 1 :]:
                    if field.startswith("KernelPageSize:"):
                        return int(field.split()[1])
    raise AssertionError(f"{address:#x} is in no mapping")


def test_a_pool_without_hugepages_is_zeroed_and_whole():
    pool = new_pool(SPEC, PAGES, hugepages=False)
    assert tuple(pool.shape) == (PAGES + 2, SPEC.page_bytes)
    assert int(pool.count_nonzero()) == 0
    assert _kernel_page_kb(pool.data_ptr()) == mmap.PAGESIZE // 1024


def test_a_hugepage_pool_is_on_2mib_pages_or_refused_with_what_to_reserve():
    _, nbytes = pool_offsets([SPEC], PAGES)
    needed = -(-nbytes // HUGEPAGE)
    try:
        pool = new_pool(SPEC, PAGES, hugepages=True)
    except HugePagesError as exc:
        assert (obtainable_hugepages() or 0) < needed, exc  # refused only when truly short
        assert f"needs {needed} free 2 MiB hugepages" in str(exc)
        assert "vm.nr_hugepages" in str(exc) and exc.user_error
        return
    assert tuple(pool.shape) == (PAGES + 2, SPEC.page_bytes)
    assert int(pool.count_nonzero()) == 0
    pool[3].fill_(7)
    assert int(pool[3].sum()) == 7 * SPEC.page_bytes
    assert _kernel_page_kb(pool.data_ptr()) == 2048


def test_an_engine_asked_for_hugepages_builds_its_pool_there_and_answers_alike(monkeypatch):
    """The pool the engine is given is the one it uses (cache, transfers' region); given on
    4 KiB pages here so that it runs on machines without hugepages."""
    asked: list[bool] = []

    def pool_on_any_pages(spec, num_pages, hugepages):
        asked.append(hugepages)
        return new_pool(spec, num_pages, hugepages=False)

    monkeypatch.setattr(shared_pages, "new_pool", pool_on_any_pages)  # the CPU platform's
    monkeypatch.setattr(engine_setup, "require_hugepages", lambda: None)  # any machine
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(dtype="fp32", num_pages=48, kv_hugepages=True) as llm:
        assert asked == [True]
        cache = llm.engine.kv_cache
        assert llm.engine.kv_pages.region.data_ptr() == cache.pool.data_ptr()
        hugepaged = llm.generate("The capital of France is", params)[0].token_ids
    with LLM(dtype="fp32", num_pages=48) as llm:
        assert asked == [True]  # not asked without the option
        assert llm.generate("The capital of France is", params)[0].token_ids == hugepaged


def _sysfs(root: Path, free: int, resv: int = 0, overcommit: int = 0, surplus: int = 0) -> Path:
    for name, value in (
        ("free", free),
        ("resv", resv),
        ("nr_overcommit", overcommit),
        ("surplus", surplus),
    ):
        (root / f"{name}_hugepages").write_text(f"{value}\n")
    return root


def test_none_to_give_is_said_before_the_model_loads(tmp_path, monkeypatch):
    assert obtainable_hugepages(_sysfs(tmp_path, free=8, resv=3, overcommit=4, surplus=1)) == 8
    assert obtainable_hugepages(tmp_path / "absent") is None  # the kernel does not say: go on
    require_hugepages(tmp_path / "absent")
    none = _sysfs(tmp_path, free=2, resv=2)
    with pytest.raises(HugePagesError, match="no free 2 MiB hugepages"):
        require_hugepages(none)
    monkeypatch.setattr(engine_setup, "require_hugepages", lambda: require_hugepages(none))
    monkeypatch.setattr(engine_setup, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(HugePagesError, match="no free 2 MiB hugepages"):
        LLM(dtype="fp32", num_pages=48, kv_hugepages=True)
