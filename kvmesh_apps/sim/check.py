"""`kvmesh sim check`: the simulator against a live mesh on this machine, same workloads.

A 1 prefill + 1 decode mesh: calibrate the cost model on it, send a small agent workload to it,
simulate the same sessions on the fitted model with the mesh's own pool size, and compare hit
ratio (points) and mean TTFT / TPOT (relative). Then a 1 prefill + 2 decode mesh (the router has
a choice): another agent workload, hit ratio compared (timing is not: the fitted slowdown of
workers sharing two CPUs is measured for one neighbour)."""

from __future__ import annotations

import asyncio
import platform
import time
from dataclasses import replace

from kvmesh_apps.sim.calibrate import MeshSetup, calibrate_on, mesh_for, model_info, preset_json
from kvmesh_apps.sim.fleet import Fleet, simulate
from kvmesh_apps.sim.gateway import Record
from kvmesh_apps.sim.mesh_run import run_sessions
from kvmesh_apps.sim.report import Figures
from kvmesh_apps.sim.workload import AgentWorkload

TIMING_BOUND = 0.30  # TTFT and TPOT means of the sim within this share of the mesh's
CHECK_WORKLOAD = AgentWorkload(
    sessions=6,
    turns=6,
    system_tokens=384,
    message_tokens=48,
    reply_tokens=16,
    think_s=3.0,
    start_s=4.0,
    seed=7,
)
# Routing with a choice: 1 prefill + 2 decode workers, sessions over two system prompts.
ROUTING_WORKLOAD = AgentWorkload(
    sessions=8,
    turns=4,
    system_tokens=256,
    systems=2,
    message_tokens=48,
    reply_tokens=8,
    think_s=1.0,
    start_s=4.0,
    seed=11,
)


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()}, {len(names)} CPUs"


def run_check(setup: MeshSetup, timed: bool = True) -> dict:
    """Timing on 1 prefill + 1 decode (calibrated there), hit ratio also on 1 + 2 (routing).
    Not `timed` (only what does not depend on time is read: a test): a quick calibration, the
    sessions' users thinking a sixth (routing: half) as long and arriving in half the time."""
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with mesh_for(setup) as mesh:
        source = f"kvmesh sim check, {started}, {machine()}"
        preset = asyncio.run(calibrate_on(mesh, setup, source, timed))
        vocab = asyncio.run(model_info(f"127.0.0.1:{mesh.grpc_port}")).vocab_size
        timing = replace(CHECK_WORKLOAD, vocab=vocab)
        if not timed:  # the users think and arrive a sixth / half as long
            timing = replace(timing, think_s=timing.think_s / 6, start_s=timing.start_s / 2)
        mesh_timing = asyncio.run(run_sessions(f"127.0.0.1:{mesh.grpc_port}", timing.build()))
    with mesh_for(setup, decode=2) as mesh:
        routing = replace(ROUTING_WORKLOAD, vocab=vocab)
        if not timed:
            routing = replace(routing, think_s=routing.think_s / 2, start_s=routing.start_s / 2)
        mesh_routing = asyncio.run(run_sessions(f"127.0.0.1:{mesh.grpc_port}", routing.build()))
    sim_timing = simulate(Fleet(1, 1, setup.routing), preset, timing.build()).records
    sim_routing = simulate(Fleet(1, 2, setup.routing), preset, routing.build()).records
    real, sim = Figures.of(mesh_timing), Figures.of(sim_timing)
    real_r, sim_r = Figures.of(mesh_routing), Figures.of(sim_routing)
    return {
        "date": started,
        "machine": machine(),
        "workload": timing.__dict__,
        "routing_workload": routing.__dict__,
        "preset": preset_json(preset),
        "mesh": real.__dict__,
        "sim": sim.__dict__,
        "mesh_routing": real_r.__dict__,
        "sim_routing": sim_r.__dict__,
        "records": {
            "mesh": [_row(r) for r in mesh_timing],
            "sim": [_row(r) for r in sim_timing],
            "mesh_routing": [_row(r) for r in mesh_routing],
            "sim_routing": [_row(r) for r in sim_routing],
        },
        "hit_ratio_points": 100 * abs(sim.hit_ratio - real.hit_ratio),
        "routing_hit_ratio_points": 100 * abs(sim_r.hit_ratio - real_r.hit_ratio),
        "ttft_rel": abs(sim.ttft_mean_s - real.ttft_mean_s) / real.ttft_mean_s,
        "tpot_rel": abs(sim.tpot_mean_s - real.tpot_mean_s) / real.tpot_mean_s,
    }


def _row(r: Record) -> tuple:
    return (r.session_id, r.turn, r.prompt_tokens, r.cached_tokens, r.ttft_s, r.tpot_s, r.decode)
