"""Which kernel build a CPU gets (AVX-512, AVX2 or none, from its /proc/cpuinfo flags) and where
builds live; runs on any machine (nothing is compiled)."""

from __future__ import annotations

import pytest

from kvmesh import env
from kvmesh.engine.kernels import build

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}


@pytest.mark.parametrize(
    ("flags", "isa", "flag"),
    [
        (AVX512, "avx512", "-mavx512f"),
        (AVX512 - {"avx512bw"}, "avx2", "-mavx2"),
        ({"avx2", "fma", "f16c"}, "avx2", "-mavx2"),
    ],
)
def test_the_build_follows_the_cpu_flags(monkeypatch, flags, isa, flag):
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    monkeypatch.setenv("KVMESH_KERNELS", "1")
    monkeypatch.delenv("KVMESH_KERNELS_ISA", raising=False)
    assert build.isa() == isa
    assert flag in build.cflags() and "-ffp-contract=off" in build.cflags()
    assert build.missing_reason() is None
    assert isa != "avx2" or not any("avx512" in f for f in build.cflags())


def test_a_cpu_without_avx2_gets_no_kernels_and_a_reason(monkeypatch):
    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse4_2", "avx", "fma"})
    monkeypatch.setenv("KVMESH_KERNELS", "1")
    monkeypatch.delenv("KVMESH_KERNELS_ISA", raising=False)
    assert build.isa() is None
    assert build.missing_reason() == "the CPU lacks avx2, f16c (and AVX-512)"


def test_kvmesh_kernels_isa_picks_avx2_on_an_avx512_cpu_and_nothing_it_lacks(monkeypatch):
    monkeypatch.setenv("KVMESH_KERNELS", "1")
    monkeypatch.setattr(build, "cpu_flags", lambda: AVX512)
    monkeypatch.setenv("KVMESH_KERNELS_ISA", "avx2")
    assert build.isa() == "avx2" and build.missing_reason() is None
    assert not any("avx512" in f for f in build.cflags())
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("KVMESH_KERNELS_ISA", "avx512")
    assert build.isa() is None
    assert build.missing_reason().startswith("the CPU lacks avx512f, avx512bw")
    monkeypatch.setenv("KVMESH_KERNELS_ISA", "sse")
    assert build.missing_reason() == "KVMESH_KERNELS_ISA=sse is none of avx512, avx2"


def test_builds_live_under_the_home_unless_kvmesh_kernels_dir_says(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVMESH_KERNELS_DIR", raising=False)
    assert env.kernels_dir() == tmp_path / "home" / "kernels"
    monkeypatch.setenv("KVMESH_KERNELS_DIR", str(tmp_path / "shared"))
    assert env.kernels_dir() == tmp_path / "shared"
