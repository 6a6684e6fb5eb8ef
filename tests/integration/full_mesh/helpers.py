"""What the tests of the full mesh share: its questions and probes of its workers."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

from kvmesh.mesh.launcher import list_workers
from tests.integration.mesh_probes import (
    router_sees_idle,
    wait_for,
)

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn."]


def workers_of(mesh):
    return asyncio.run(list_workers(mesh.etcd.endpoint, "default"))


def metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def decisions(mesh, role: str, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.http_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    wanted = f'role="{role}"', f'reason="{reason}"'
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvmesh_routing_decisions_total{") and all(w in line for w in wanted)
    )


def wait_until_idle(mesh, timeout_s: float = 60.0) -> None:
    """No worker has tokens in flight, as the gateway's load poll last saw them."""
    wait_for(lambda: router_sees_idle(mesh), timeout_s, "workers still busy after earlier tests")


def kill_busy_decode(mesh) -> None:
    for worker in workers_of(mesh):
        if worker.role == "decode" and metric(worker.metrics_address, "kvmesh_kv_pages_used") > 0:
            proc = mesh.procs[worker.worker_id]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            return
    raise AssertionError("no decode worker holds pages mid-stream")
