"""`kvmesh bench serve --workload agent`'s sessions against a real mesh (1 prefill, 1 decode,
cache-aware): with `x-session-affinity`, each turn finds the previous turn's prompt cached."""

from __future__ import annotations

import os

import pytest

from kvmesh.mesh.launcher import Mesh, UpOptions
from kvmesh.mesh.up_config import gateway_config, worker_configs
from kvmesh_apps.benchmarks.agent import Workload, hit_ratio, run_workload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PAGE_TOKENS = 16


def test_turns_reuse_the_session_prefix():
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    options = UpOptions(
        workers=worker_configs("--kv-cache-mib", "128"),
        prefill=1,
        decode=1,
        gateway=gateway_config("--routing", "cache-aware"),
    )
    mesh = Mesh(options)
    try:
        mesh.start()
        url = f"http://127.0.0.1:{mesh.http_port}"
        workload = Workload(sessions=2, turns=3, max_tokens=4, system_tokens=300)
        records = run_workload(url, workload)
    finally:
        mesh.stop()
    assert all(proc.poll() is not None for proc in mesh.procs.values())
    by_key = {(r.session, r.turn): r for r in records}
    assert sorted(by_key) == [(s, t) for s in (0, 1) for t in (1, 2, 3)]
    for (session, turn), r in by_key.items():
        assert r.ttft_s > 0 and r.prompt_tokens > 300
        if turn >= 2:
            previous = by_key[(session, turn - 1)].prompt_tokens
            assert r.prompt_tokens > previous
            assert r.cached_tokens >= previous // PAGE_TOKENS * PAGE_TOKENS, (session, turn)
    assert hit_ratio(records) > 0.5
