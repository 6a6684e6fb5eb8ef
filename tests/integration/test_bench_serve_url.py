"""`kvmesh bench serve --url` against a real mesh whose workers are pinned (prefill to CPU 0,
decode to CPU 1): the report's fields, exact output lengths counted from the usage chunk, the
model taken from /v1/models; and each worker's threads on its own CPU with one torch thread."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvmesh.mesh.launcher import Mesh, UpOptions
from kvmesh.mesh.up_config import worker_configs
from kvmesh_apps.benchmarks import serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PINS = {"prefill": "0", "decode": "1"}


@pytest.fixture(scope="module")
def pinned_mesh():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPUs 0 and 1")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    mesh = Mesh(UpOptions(workers=worker_configs("--kv-cache-mib", "64"), role_cpus=PINS))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def test_bench_serve_url_reports_exact_lengths(pinned_mesh, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = [
        "--url",
        f"http://127.0.0.1:{pinned_mesh.http_port}/v1",
        "--concurrency",
        "1,2",
        "--requests-per-level",
        "2",
        "--max-tokens",
        "8",
        "--single-stream-requests",
        "1",
        "--long-prompt-requests",
        "1",
        "--long-prompt-tokens",
        "120",
        "--output",
        str(out),
    ]
    assert serve.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "smollm2-135m"  # what the server's /v1/models lists first
    assert report["lengths_exact"] is True
    assert [r["concurrency"] for r in report["levels"]] == [1, 2]
    for row in [report["single_stream"], *report["levels"]]:
        assert row["counted_by"] == ["usage"] and row["inexact_requests"] == 0
        assert [r["tokens"] for r in row["requests"]] == [8] * row["num_requests"]
        assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] > 0 and row["tpot_p90_ms"] > 0
    assert report["single_stream"]["decode_tok_s"] > 0
    (size,) = report["long_prompt"]["prompt_tokens"]
    assert 100 <= size <= 140  # sized with the server's own tokenizer
    assert report["engine"] == [] and report["overhead"] == []


def test_workers_run_on_their_cpus_with_one_torch_thread(pinned_mesh) -> None:
    for role, cpus in PINS.items():
        name = f"{role}-0"
        pid = pinned_mesh.procs[name].pid
        threads = list(Path(f"/proc/{pid}/task").iterdir())
        assert len(threads) > 1
        assert all(os.sched_getaffinity(int(t.name)) == {int(cpus)} for t in threads)
        log = (pinned_mesh.run_dir / f"{name}.log").read_text()
        line = next(line for line in log.splitlines() if "worker.cpus" in line)
        assert json.loads(line)["cpus"] == cpus
        assert json.loads(line)["torch_threads"] == 1 and json.loads(line)["pinned"] is True
