"""`kvmesh status`: the workers registered in etcd, with their live load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from kvmesh.errors import NoMeshError
from kvmesh.mesh import tls
from kvmesh.mesh.discovery import Registry, WorkerInfo
from kvmesh.mesh.grpc_server import channel
from kvmesh.mesh.launcher import state_file
from kvmesh.mesh.tls import TlsFiles
from kvmesh.proto.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc


def run_status(etcd: str | None, cluster: str | None, as_json: bool) -> int:
    etcd, cluster = _locate(etcd, cluster)
    workers = asyncio.run(_collect(etcd, cluster))
    if as_json:
        print(json.dumps({"etcd": etcd, "cluster": cluster, "workers": workers}))
        return 0
    for w in workers:
        load = w.get("load") or {}
        delivery = f"delivery={w['delivery']} " if w.get("delivery") else ""
        print(
            f"{w['role']:8} {w['id']:14} grpc={w['grpc']} metrics={w['metrics']} {delivery}"
            f"arch={w['precision'].get('architecture', '?')} "
            f"weights={w['precision'].get('weights', '?')} kv={w['kv_dtype']} capacity={w['capacity_tokens']} "
            f"kv_spec={w['precision'].get('kv_spec', '?')} "
            f"running={load.get('numRunning', 0)} pages={load.get('kvPagesUsed', 0)}/{load.get('kvPagesTotal', 0)}"
        )
        for rank in w["ranks"]:
            print(
                f"{'':8} rank {rank['rank']} pid={rank['pid']} device={rank['device']} "
                f"anon={rank.get('rssanon', '?')}MiB shmem={rank.get('rssshmem', '?')}MiB"
            )
    return 0


def _locate(etcd: str | None, cluster: str | None) -> tuple[str, str]:
    if etcd:
        return etcd, cluster or "default"
    if not state_file().is_file():
        raise NoMeshError(
            "no running mesh found (start one with `kvmesh up`, or pass --etcd host:port)"
        )
    state = json.loads(state_file().read_text())
    if state.get("tls"):  # `kvmesh up --tls`: the workers answer only the mesh's certificate
        tls.configure(TlsFiles(**{k: Path(v) for k, v in state["tls"].items()}))
    return state["etcd"], cluster or state.get("cluster", "default")


async def _collect(etcd: str, cluster: str) -> list[dict]:
    async with Registry(etcd, cluster) as registry:
        workers = await registry.list_workers()
    return [await _describe(w) for w in sorted(workers, key=lambda w: (w.role, w.worker_id))]


async def _describe(worker: WorkerInfo) -> dict:
    stub_cls = (
        prefill_pb2_grpc.PrefillStub if worker.role == "prefill" else decode_pb2_grpc.DecodeStub
    )
    load = None
    try:
        async with channel(worker.grpc_address) as ch:
            response = await stub_cls(ch).GetLoads(decode_pb2.GetLoadsRequest(), timeout=2)
            load = (
                MessageToDict(response.loads[0], always_print_fields_with_no_presence=True)
                if response.loads
                else None
            )
    except grpc.aio.AioRpcError:
        load = None
    return {
        "role": worker.role,
        "id": worker.worker_id,
        "grpc": worker.grpc_address,
        "metrics": worker.metrics_address,
        "te_session": worker.te_session,
        "delivery": worker.delivery_address,
        "precision": dict(worker.extra),
        "ranks": json.loads(worker.extra.get("ranks", "[]")),
        "kv_dtype": worker.kv_dtype,
        "capacity_tokens": worker.capacity_tokens,
        "load": load,
    }
