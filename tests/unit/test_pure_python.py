"""The KV bookkeeping, the scheduler and the simulator import on a host without torch or
numpy."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import importlib, sys

    BLOCKED = ("torch", "numpy")

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    for module in (
        "kvmesh.engine.kv",
        "kvmesh.engine.kv.block_manager",
        "kvmesh.engine.core.scheduler",
        "kvmesh.engine.core.sequence",
        "kvmesh.engine.core.sampling_params",
        "kvmesh.engine.core.step",
        "kvmesh.engine.core.scheduled",
        "kvmesh.engine.kv.layout",
        "kvmesh.engine.models.registry",
        "kvmesh.engine.loader.hf_config",
        "kvmesh_apps.sim.fleet",  # the simulator: the router and the pool, no model
        "kvmesh_apps.sim.report",
    ):
        importlib.import_module(module)
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker did not block numpy")
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("ok")
    """
)


def test_engine_core_imports_without_torch_or_numpy() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
