"""`kvmesh sim` against a real mesh on this machine: the same small agent workload through a
1 prefill + 1 decode mesh and through the simulator with a cost model fitted to that mesh
(and its pool size), then another through 1 prefill + 2 decode workers (the router chooses).
The issue's bounds: hit ratio within 5 points, TTFT and TPOT within 30 % (means).

The timing bounds compare a mesh run with a fit made minutes earlier on a shared 2-core VM: a
neighbour's load in between slows the mesh alone (seen once in `make test`: TPOT 54 vs 36 ms,
the fit's probes unslowed). A timing miss is therefore checked once more from a new fit; the
hit ratios, which do not depend on time, must hold on every attempt."""

from __future__ import annotations

import json

import pytest

from kvmesh.sim.calibrate import MeshSetup
from kvmesh.sim.check import run_check

pytestmark = pytest.mark.timeout(900)  # ~2.5 min an attempt here
ATTEMPTS = 2  # a timing miss is checked once more (see above)


def test_the_simulator_reproduces_a_mesh_run(tmp_path):
    misses: list[str] = []
    for attempt in range(ATTEMPTS):
        result = run_check(MeshSetup())
        (tmp_path / f"check-{attempt}.json").write_text(json.dumps(result, indent=1))
        summary = _check_untimed(result)
        if result["ttft_rel"] <= 0.30 and result["tpot_rel"] <= 0.30:
            return
        misses.append(
            f"TTFT {result['ttft_rel']:.0%}, TPOT {result['tpot_rel']:.0%} off: {summary}"
        )
    raise AssertionError("TTFT or TPOT off by more than 30 % on every attempt:\n" +
                         "\n".join(misses))  # fmt: skip


def _check_untimed(result: dict) -> str:
    """The asserts that do not depend on time; returns the figures as JSON."""
    mesh, sim = result["mesh"], result["sim"]
    summary = json.dumps({"mesh": mesh, "sim": sim, "preset": result["preset"]})
    assert mesh["errors"] == 0 and sim["errors"] == 0 and mesh["requests"] == sim["requests"]
    assert mesh["hit_ratio"] > 0.5, summary  # the workload does reuse its prefixes
    assert result["hit_ratio_points"] <= 5, summary
    # 1 prefill + 2 decode workers: the router chooses, the same way in both
    real, sim = result["mesh_routing"], result["sim_routing"]
    assert real["errors"] == 0 and sim["errors"] == 0 and real["hit_ratio"] > 0.5, summary
    assert result["routing_hit_ratio_points"] <= 5, json.dumps({"mesh": real, "sim": sim})
    used = {row[-1] for row in result["records"]["sim_routing"]}
    assert used == {"decode-0", "decode-1"}, used  # the router did choose (the client cannot
    # see which worker served; the equal hit ratio says the mesh chose alike)
    return summary
