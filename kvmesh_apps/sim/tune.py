"""The last step of `kvmesh sim calibrate`: the prefill worker's shared-CPU slowdown and the
decode steps' scale chosen so that the simulator reproduces an agent workload run on the same
mesh (its mean TTFT and TPOT). What the probes cannot see (a worker's event loop and the gateway
under load, new sequences joining a decode batch, the machine busier than during the probes)
ends up in these two factors; `kvmesh sim check` then validates on
another workload (another seed)."""

from __future__ import annotations

from dataclasses import replace

from kvmesh_apps.sim.fleet import Fleet, simulate
from kvmesh_apps.sim.gateway import Record
from kvmesh_apps.sim.presets import Preset
from kvmesh_apps.sim.report import Figures
from kvmesh_apps.sim.workload import AgentWorkload

TUNE_WORKLOAD = AgentWorkload(
    sessions=6,
    turns=6,
    system_tokens=384,
    message_tokens=48,
    reply_tokens=16,
    think_s=3.0,
    start_s=4.0,
    seed=3,
)
MAX_SLOWDOWN = 6.0  # the prefill slowdown's range: 0 to this
SCALES = (0.6, 2.6)  # the decode scale's range
GRID = 20  # steps over each range
ONE_AND_ONE = Fleet(1, 1)  # the mesh calibrate starts


def means(records: list[Record]) -> tuple[float, float]:
    """(mean TTFT, mean TPOT) of the requests that succeeded (what `kvmesh sim check`
    compares)."""
    figures = Figures.of(records)
    return figures.ttft_mean_s, figures.tpot_mean_s


def tune(
    preset: Preset, workload: AgentWorkload, measured: list[Record], fleet: Fleet = ONE_AND_ONE
) -> Preset:
    """The prefill slowdown and the decode scale on a grid that bring the simulated mean TTFT
    and TPOT closest to the measured ones (sum of squared relative errors): both depend on both
    (a slower decode step also delays reservations and commits), so they are chosen together.
    The decode slowdown stays as the probes measured it."""
    ttft, tpot = means(measured)
    best, chosen = float("inf"), preset
    for i in range(GRID + 1):
        for j in range(GRID + 1):
            cost = replace(
                preset.cost,
                prefill_slowdown=i * MAX_SLOWDOWN / GRID,
                decode_scale=SCALES[0] + j * (SCALES[1] - SCALES[0]) / GRID,
            )
            candidate = replace(preset, cost=cost)
            got_ttft, got_tpot = means(simulate(fleet, candidate, workload.build()).records)
            error = (got_ttft / ttft - 1) ** 2 + (got_tpot / tpot - 1) ** 2
            if error < best:
                best, chosen = error, candidate
    return chosen
