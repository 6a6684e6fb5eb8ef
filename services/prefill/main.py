"""The prefill worker process."""

from __future__ import annotations

from kvmesh.config import WorkerConfig
from kvmesh.mesh.affinity import apply_worker_cpus
from kvmesh.mesh.worker_runtime import WorkerParts, serve_worker
from services.prefill.server import PrefillServicer, add_to
from services.prefill.worker import PrefillWorker


def servicers(parts: WorkerParts) -> list:
    worker = PrefillWorker(parts.engine, parts.transfer, parts.kv_dtype, parts.store)
    return [add_to(PrefillServicer(worker, parts.worker_id, parts.gate))]


async def serve_prefill(config: WorkerConfig) -> int:
    apply_worker_cpus()  # KVMESH_CPUS / --cpus, before the engine sizes its torch pool
    return await serve_worker(config, servicers)
