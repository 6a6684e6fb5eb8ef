"""The last step of `kvmesh sim calibrate`: the two shared-CPU slowdowns chosen so that the
simulator reproduces an agent workload run on the same mesh (its TTFT and TPOT p50). The probes
alone leave what they cannot see (a worker's event loop and the gateway under load, a
decode-step wait more or less) in these two factors; `kvmesh sim check` then validates on
another workload (another seed)."""

from __future__ import annotations

from dataclasses import replace

from kvmesh.sim.fleet import Fleet, simulate
from kvmesh.sim.gateway import Record
from kvmesh.sim.presets import Preset
from kvmesh.sim.report import percentile
from kvmesh.sim.workload import AgentWorkload

TUNE_WORKLOAD = AgentWorkload(sessions=4, turns=5, system_tokens=384, message_tokens=48,
                              reply_tokens=16, think_s=2.0, start_s=4.0, seed=3)  # fmt: skip
MAX_SLOWDOWN = 4.0
GRID = 20  # steps of MAX_SLOWDOWN / GRID
ONE_AND_ONE = Fleet(1, 1)  # the mesh calibrate starts


def p50s(records: list[Record]) -> tuple[float, float]:
    """(TTFT p50, TPOT p50) of the requests that succeeded."""
    done = [r for r in records if not r.error]
    return (percentile([r.ttft_s for r in done if r.ttft_s is not None], 50) or 0.0,
            percentile([r.tpot_s for r in done if r.tpot_s is not None], 50) or 0.0)  # fmt: skip


def tune(preset: Preset, workload: AgentWorkload, measured: list[Record],
         fleet: Fleet = ONE_AND_ONE) -> Preset:  # fmt: skip
    """The (prefill, decode) slowdowns on a grid that bring the simulated TTFT and TPOT p50
    closest to the measured ones (sum of squared relative errors): both depend on both (a
    slower decode step also delays reservations and commits), so they are chosen together."""
    ttft, tpot = p50s(measured)
    best, chosen = float("inf"), preset
    for i in range(GRID + 1):
        for j in range(GRID + 1):
            cost = replace(preset.cost, prefill_slowdown=i * MAX_SLOWDOWN / GRID,
                           decode_slowdown=j * MAX_SLOWDOWN / GRID)  # fmt: skip
            candidate = replace(preset, cost=cost)
            got_ttft, got_tpot = p50s(simulate(fleet, candidate, workload.build()).records)
            error = (got_ttft / ttft - 1) ** 2 + (got_tpot / tpot - 1) ** 2
            if error < best:
                best, chosen = error, candidate
    return chosen
