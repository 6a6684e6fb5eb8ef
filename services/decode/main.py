"""The decode worker process."""

from __future__ import annotations

import functools

from kvmesh.config import WorkerConfig
from kvmesh.mesh import tls
from kvmesh.mesh.affinity import apply_worker_cpus
from kvmesh.mesh.worker_runtime import WorkerParts, serve_worker
from services.decode.delivery import Deliveries, DeliverySocket
from services.decode.server import DecodeServicer, add_to
from services.decode.worker import DecodeWorker


def servicers(parts: WorkerParts, deliveries: Deliveries) -> list:
    worker = DecodeWorker(
        parts.engine,
        parts.transfer.session,
        parts.kv_dtype,
        parts.config.serving.local_prefill_tokens,
    )
    if parts.store is not None:
        parts.store.enable_export()  # finished sequences' pages go to the KV store
    return [add_to(DecodeServicer(worker, parts.worker_id, deliveries, parts.gate))]


async def serve_decode(config: WorkerConfig) -> int:
    apply_worker_cpus()  # KVMESH_CPUS / --cpus, before the engine sizes its torch pool
    deliveries = Deliveries()  # served on the delivery socket and as Decode.Deliver
    make = functools.partial(servicers, deliveries=deliveries)
    # the delivery socket is plain TCP: with TLS every chunk goes on the (TLS) Generate call
    socket = DeliverySocket(deliveries) if tls.current() is None else None
    return await serve_worker(config, make, socket)
