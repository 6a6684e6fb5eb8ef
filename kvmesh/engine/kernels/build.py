"""Build (once per source, torch and compiler) and load the C++ CPU kernels of csrc/.

The extension is compiled by the machine's own compiler through torch.utils.cpp_extension into
`$KVMESH_KERNELS_DIR/<key>/` (default `$KVMESH_HOME/kernels/`), where `key` hashes the sources,
torch's version and the flags: `make install` builds it ahead (`python -m kvmesh.engine.kernels.build`), and a process that
finds no build compiles it on first use (torch's lock file keeps concurrent builds apart).
They are built for one of two instruction sets, whichever the CPU has: AVX-512 (F, BW, VL, DQ;
AVX512-BF16 dot products and AMX tiles used where present) or AVX2 (AMD Zen 1-3, Intel before
Skylake-SP), both with FMA and F16C (csrc/vec.h holds the two). Elsewhere, or with
`KVMESH_KERNELS=0`, nothing is built and the torch reference paths run; with
`KVMESH_KERNELS_ISA=avx2` an AVX-512 CPU builds and runs the AVX2 kernels.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from types import ModuleType

import structlog

from kvmesh import env

log = structlog.get_logger(__name__)
SOURCES = Path(__file__).parent / "csrc"
NAME = "kvmesh_cpu_kernels"
# (CPU flags a build needs, its compiler flags), best first
ISAS = {
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"),
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    ),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
}
COMMON_CFLAGS = [
    "-O3",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-fopenmp",
]  # at::parallel_for is inline OpenMP: without it every call runs serially


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def isa() -> str | None:
    """The instruction set the kernels are built for on this CPU (None: neither): the best it
    runs, or the one KVMESH_KERNELS_ISA names if it runs that."""
    flags, chosen = cpu_flags(), env.kernels_isa()
    names = [name for name in ISAS if chosen in (None, name)]
    return next((name for name in names if set(ISAS[name][0]) <= flags), None)


def cflags() -> list[str]:
    return COMMON_CFLAGS + ISAS[isa() or "avx2"][1]


def missing_reason() -> str | None:
    """Why the kernels cannot run here (None: they can)."""
    if not env.cpu_kernels():
        return "disabled by KVMESH_KERNELS=0"
    if sys.platform != "linux":
        return f"built for Linux x86-64 only, not {sys.platform}"
    if (chosen := env.kernels_isa()) is not None and chosen not in ISAS:
        return f"KVMESH_KERNELS_ISA={chosen} is none of {', '.join(ISAS)}"
    if isa() is None:
        lacking = ", ".join(f for f in ISAS[chosen or "avx2"][0] if f not in cpu_flags())
        return f"the CPU lacks {lacking}" + (f" ({chosen})" if chosen else " (and AVX-512)")
    return None


def build_key() -> str:
    import torch

    digest = hashlib.sha256(torch.__version__.encode() + " ".join(cflags()).encode())
    for path in sorted(SOURCES.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def load() -> ModuleType:
    """The compiled module, building it if this key has no build yet (raises on failure)."""
    directory = env.kernels_dir() / build_key()
    built = directory / f"{NAME}.so"
    if built.exists() and not (directory / "lock").exists():  # built, no build running: import it
        import importlib.util

        import torch  # noqa: F401  (the extension links against libtorch)

        spec = importlib.util.spec_from_file_location(NAME, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    module = cpp_extension.load(
        name=NAME,
        sources=[str(p) for p in sorted(SOURCES.glob("*.cpp"))],
        extra_cflags=cflags(),
        extra_ldflags=["-fopenmp"],  # libgomp.so.1: the one torch has loaded already
        extra_include_paths=[str(SOURCES)],
        build_directory=str(directory),
        verbose=False,
    )
    seconds = time.perf_counter() - started
    if seconds > 2:
        log.info("kernels.built", directory=str(directory), seconds=round(seconds, 1))
    return module


def main() -> int:
    reason = missing_reason()
    if reason:
        print(f"CPU kernels not built: {reason}; the torch paths will run")
        return 0
    load()
    import torch

    print(f"CPU kernels ready ({isa()}; AVX512-BF16 dot: {torch.ops.kvmesh.has_bf16_dot()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
