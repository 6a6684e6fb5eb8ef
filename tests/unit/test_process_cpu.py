"""CPU accounting of mesh processes for `kvmesh bench serve` (benchmarks/process_cpu.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from kvmesh_apps.benchmarks.process_cpu import CLIENT, CpuMeter, tree_cpu_s

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"


def test_a_process_tree_counts_its_busy_descendants():
    # the busy process is a grandchild: `sh` itself only waits
    parent = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{BUSY}' & wait"])
    try:
        meter = CpuMeter({"tree": parent.pid})
        before = meter.sample()
        time.sleep(0.9)
        after = meter.sample()
        assert after["tree"] - before["tree"] >= 0.4  # the grandchild spun meanwhile
        assert after[CLIENT] - before[CLIENT] < 0.4  # this process slept
        split = CpuMeter.per_token(before, after, tokens=10)
        assert split["tree"] == round((after["tree"] - before["tree"]) * 100, 3)
    finally:
        parent.wait(10)


def test_a_gone_process_counts_nothing_and_no_tokens_no_split():
    done = subprocess.Popen(["true"])
    done.wait()
    assert tree_cpu_s(done.pid) == 0.0
    assert CpuMeter.per_token({"a": 1.0}, {"a": 2.0}, tokens=0) == {}
