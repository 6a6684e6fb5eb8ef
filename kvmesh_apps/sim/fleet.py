"""One simulated run: a fleet (prefill and decode workers, or colocated workers that do both),
a routing policy from the gateway's router, a workload; the result is the clients' records."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.mesh.kv_events import PrefixIndex
from kvmesh.mesh.worker_info import WorkerInfo
from kvmesh.routing.prefix import PrefixLookup
from kvmesh.routing.router import AffinityPolicy, make_router, reported_load
from kvmesh_apps.sim.clock import Clock
from kvmesh_apps.sim.gateway import Record, SimGateway
from kvmesh_apps.sim.presets import Preset
from kvmesh_apps.sim.worker import SimWorker
from kvmesh_apps.sim.workload import Session

POLL_S = 1.0  # how often the gateway polls workers' loads (Router.poll_loads' period)


@dataclass(frozen=True)
class Fleet:
    prefill: int  # 0: colocated (decode workers compute prompts themselves)
    decode: int
    routing: str = "cache-aware"
    affinity_max_load_ratio: float = 2.0
    affinity_slack_tokens: int = 2048

    @property
    def label(self) -> str:
        shape = f"{self.prefill}P+{self.decode}D" if self.prefill else f"{self.decode} colocated"
        return f"{shape}, {self.routing}"


@dataclass
class Run:
    fleet: Fleet
    records: list[Record]
    workers: list[SimWorker]
    sim_s: float  # simulated time until the last reply


def simulate(
    fleet: Fleet, preset: Preset, sessions: list[Session], horizon_s: float | None = None
) -> Run:
    """Run `sessions` through the fleet to the end (or to `horizon_s` of simulated time)."""
    clock, index = Clock(), PrefixIndex()
    workers = _workers(fleet, preset, clock, index)
    by_role = {
        role: [w.info for w in workers if w.info.role == role] for role in ("prefill", "decode")
    }
    affinity = AffinityPolicy(fleet.affinity_max_load_ratio, fleet.affinity_slack_tokens)
    router = make_router(
        lambda role: by_role.get(role, []), fleet.routing, PrefixLookup(index), affinity
    )
    gateway = SimGateway(clock, router, {w.worker_id: w for w in workers}, preset)
    left = [len(sessions)]

    def turn(session: Session) -> None:
        gateway.send(session, lambda reply: replied(session, reply))

    def replied(session: Session, reply: list[int] | None) -> None:
        if reply is not None and session.replied(reply):
            clock.after(session.think_s, turn, session)
        else:
            left[0] -= 1

    def poll() -> None:
        for worker in workers:
            router.report(worker.worker_id, reported_load(worker.info.role, *worker.load_tokens()))
        if left[0]:
            clock.after(POLL_S, poll)

    for session in sessions:
        clock.at(session.start_s, turn, session)
    clock.at(0.0, poll)
    clock.run(horizon_s)
    last = max((r.token_times[-1] for r in gateway.records if r.token_times), default=0.0)
    return Run(fleet, gateway.records, workers, last)


def _workers(fleet: Fleet, preset: Preset, clock: Clock, index: PrefixIndex) -> list[SimWorker]:
    spec = preset.worker
    out = []
    for role, count in (("prefill", fleet.prefill), ("decode", fleet.decode)):
        for i in range(count):
            info = WorkerInfo(
                role,
                f"{role}-{i}",
                f"sim:{role}-{i}",
                model=preset.model,
                page_size=spec.page_size,
                kv_dtype=preset.kv_dtype,
                capacity_tokens=spec.kv_pages * spec.page_size,
            )
            out.append(SimWorker(info, preset, clock, index))
    if preset.shared_host:  # the fitted model: every worker on this machine's CPUs
        for worker in out:
            worker.neighbours = [w for w in out if w is not worker]
    return out
