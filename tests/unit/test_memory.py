"""peak_rss_bytes measures this process only: not the peak of the process that started it
(Linux carries ru_maxrss across execve, so a probe started by a large pytest process would
report pytest's peak)."""

from __future__ import annotations

import subprocess
import sys

from kvmesh.engine.loader.memory import current_rss_bytes, peak_rss_bytes


def test_a_child_does_not_inherit_its_parents_peak():
    ballast = bytearray(400 << 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # resident in this process
    assert peak_rss_bytes() > 400 << 20
    code = "from kvmesh.engine.loader.memory import peak_rss_bytes as p; print(p())"
    child = int(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert child < 200 << 20
    assert current_rss_bytes() <= peak_rss_bytes()
    del ballast
