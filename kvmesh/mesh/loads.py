"""EngineLoad -> WorkerLoad proto."""

from __future__ import annotations

from kvmesh.engine.serving.engine_load import EngineLoad
from kvmesh.proto.v1 import common_pb2


def load_to_pb(load: EngineLoad, worker_id: str, role: str) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        worker_id=worker_id,
        role=role,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        prefill_tokens_queued=load.prefill_tokens_queued,
        kv_tokens_active=load.kv_tokens_active,
        kv_capacity_tokens=load.kv_capacity_tokens,
        kv_pages_used=load.kv_pages_used,
        kv_pages_total=load.kv_pages_total,
        kv_pages_hashed=load.kv_pages_hashed,
    )
