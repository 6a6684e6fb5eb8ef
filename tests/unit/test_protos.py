"""The committed gRPC stubs are what `make protos` generates from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_fresh(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    committed = ROOT / "kvmesh" / "proto" / "v1"
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == sorted(p.name for p in committed.iterdir() if p.name != "__pycache__")
    stale = [
        name
        for name in generated
        if (tmp_path / name).read_text() != (committed / name).read_text()
    ]
    assert not stale, f"stale stubs (run `make protos`): {stale}"
