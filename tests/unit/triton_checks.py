"""How a Triton kernel check runs: its script (a test module's CHECK, with `{device}` in it) in
a subprocess, on CPU tensors under TRITON_INTERPRET=1 (which must be set before triton is
imported) and, where there is one, on the GPU (scripts/device_check.py runs the same scripts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def run_check(check: str, device: str) -> None:
    """Run `check` on `device`; it prints "ok" last when every assertion held."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if device == "cpu" else "0"}
    result = subprocess.run(
        [sys.executable, "-c", check.format(device=device)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), result.stderr[-3000:]
