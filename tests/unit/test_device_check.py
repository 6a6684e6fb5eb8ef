"""scripts/device_check.py (what only a GPU runs: see its docstring) stays runnable where no GPU
is: its dry run times the attention and probe sections tiny on the CPU under the interpreter,
and it finds the kernel checks' scripts in tests/unit without importing them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def test_the_dry_run_writes_every_section_without_error(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "device_check.py"),
            "--dry-run",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["env"]["device"] == "cpu"
    assert set(report["attention"]) >= {"gqa/bf16/b1/ctx256", "mla/bf16/b2/ctx64"}
    assert report["probe"]["w4a16_gemv_us"] > 0


def test_it_finds_each_kernel_check_script():
    import device_check

    for name in device_check.KERNEL_CHECKS:
        script = device_check._check_script(ROOT / "tests" / "unit" / name)
        assert script.startswith("\nimport torch") and "{device}" in script
