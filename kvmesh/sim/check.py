"""`kvmesh sim check`: the simulator against a live mesh on this machine, same workload.

One mesh: calibrate the cost model on it, send a small agent workload to it, simulate the same
sessions on the fitted model with the mesh's own pool size, and compare hit ratio (points) and
TTFT / TPOT p50 (relative)."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

from kvmesh.sim.calibrate import MeshSetup, fit, fitted, mesh_for, preset_json, probe, worker_spec
from kvmesh.sim.fleet import Fleet, simulate
from kvmesh.sim.gateway import Record
from kvmesh.sim.mesh_run import run_sessions
from kvmesh.sim.report import percentile
from kvmesh.sim.workload import AgentWorkload

CHECK_WORKLOAD = AgentWorkload(sessions=4, turns=5, system_tokens=384, message_tokens=48,
                               reply_tokens=16, think_s=2.0, start_s=4.0, vocab=30000, seed=7)  # fmt: skip


@dataclass(frozen=True)
class Figures:
    hit_ratio: float
    ttft_p50_s: float
    tpot_p50_s: float
    requests: int
    errors: int

    @classmethod
    def of(cls, records: list[Record]) -> Figures:
        done = [r for r in records if not r.error]
        prompt = sum(r.prompt_tokens for r in done) or 1
        return cls(sum(r.cached_tokens for r in done) / prompt,
                   percentile([r.ttft_s for r in done if r.ttft_s is not None], 50) or 0.0,
                   percentile([r.tpot_s for r in done if r.tpot_s is not None], 50) or 0.0,
                   len(records), len(records) - len(done))  # fmt: skip


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()}, {len(names)} CPUs"


def run_check(setup: MeshSetup, workload: AgentWorkload = CHECK_WORKLOAD) -> dict:
    import asyncio

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with mesh_for(setup) as mesh:
        address = f"127.0.0.1:{mesh.grpc_port}"
        probes = asyncio.run(probe(address, setup.vocab))
        spec, info = asyncio.run(worker_spec(mesh, setup))
        cost = fit(probes, f"kvmesh sim check/calibrate, {started}, {machine()}")
        mesh_records = asyncio.run(run_sessions(address, workload.build()))
    preset = fitted(cost, spec, info)
    run = simulate(Fleet(1, 1, setup.routing), preset, workload.build())
    real, sim = Figures.of(mesh_records), Figures.of(run.records)
    return {
        "date": started, "machine": machine(), "workload": workload.__dict__,
        "preset": preset_json(cost, spec, info),
        "probes": {"prefill": probes.prefill, "decode": probes.decode},
        "mesh": real.__dict__, "sim": sim.__dict__,
        "records": {"mesh": [_row(r) for r in mesh_records], "sim": [_row(r) for r in run.records]},
        "hit_ratio_points": 100 * abs(sim.hit_ratio - real.hit_ratio),
        "ttft_rel": abs(sim.ttft_p50_s - real.ttft_p50_s) / real.ttft_p50_s,
        "tpot_rel": abs(sim.tpot_p50_s - real.tpot_p50_s) / real.tpot_p50_s,
    }  # fmt: skip


def _row(r: Record) -> tuple:
    return (r.session_id, r.turn, r.prompt_tokens, r.cached_tokens, r.ttft_s, r.tpot_s)
