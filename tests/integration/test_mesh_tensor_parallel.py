"""Tensor-parallel workers in the mesh (real processes, openai client): a prefill worker of two
ranks feeding a decode worker of one, both staging their pages through host mirrors (each rank
its own pool), and the reverse (two decode workers of two ranks each).
KV pages cross between the layouts in the transfer engine's writes (heads re-sharded), and
pages a decode worker holds are read back by the prefill worker the same way. Greedy text
equals the single-process engine; injected faults (a lost transfer page, a stale writer) are
still caught by the integrity tags. Last: one rank of a decode worker is SIGKILLed mid-stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import worker_configs
from tests.integration.chat_client import ask_or_error, client_for
from tests.integration.mesh_probes import mesh_with_faults, metric_sum, samples, wait_for

pytestmark = pytest.mark.timeout(900)
# (prefill ranks, decode ranks, decode workers)
# the first with both workers' pages reached through host mirrors (`--kv-transfer staged`, the
# GPU pools' mode, here on CPU pools): each prefill rank stages its own heads' pool
SETUPS = {"prefill-tp2/decode-tp1-staged": (2, 1, 1), "prefill-tp1/decode-tp2": (1, 2, 2)}
FAULTS = "drop_transfer@5,overwrite@90"
WORKER_ARGS = (
    "--kv-cache-memory",
    "48MiB",
    "--max-num-seqs",
    "8",
    "--kv-integrity-action",
    "abort",
)  # a dropped page shows as an error here
TOPICS = ["tides", "volcanoes", "bees", "comets", "glaciers", "owls", "deserts"]
LONG = " ".join(f"Note {i}: lighthouses guide ships past rocks at night." for i in range(12))
MAX_TOKENS = 20


@pytest.fixture(scope="module", params=sorted(SETUPS))
def mesh(request):
    prefill_tp, decode_tp, decode = SETUPS[request.param]
    transfer = ("--kv-transfer", "staged" if request.param.endswith("staged") else "direct")
    options = UpOptions(
        workers=worker_configs(
            *WORKER_ARGS,
            *transfer,
            prefill=("--tensor-parallel-size", str(prefill_tp)),
            decode=("--tensor-parallel-size", str(decode_tp)),
        ),
        prefill=1,
        decode=decode,
        kvstore="none",
    )
    with mesh_with_faults(options, FAULTS) as running:
        yield SETUPS[request.param], running
    for proc in running.procs.values():
        assert proc.poll() is not None, "a mesh process outlived the fixture"


@pytest.fixture(scope="module")
def reference():
    return LLM(dtype="fp32", kv_cache_bytes=48 << 20)


def _workers(mesh):
    return asyncio.run(list_workers(mesh.etcd.endpoint, "default"))


def _ask(
    client,
    reference,
    messages,
    stream: bool,
    errors: list[str],
    headers: dict[str, str] | None = None,
) -> str | None:
    """The mesh's answer, checked against the engine's: equal, or a kv_integrity error after
    a correct beginning (None then)."""
    want = reference.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    got, code = ask_or_error(client, messages, stream, "smollm2-135m", MAX_TOKENS, headers)
    if code is None:
        assert got == want[0].text, messages
        return got
    assert code == "kv_integrity", (messages, code)
    assert want[0].text.startswith(got), (messages, got)
    errors.append(code)
    return None


def test_layouts_are_advertised(mesh):
    (prefill_tp, decode_tp, _), running = mesh
    workers = _workers(running)
    assert {w.role: int(w.extra["tensor_parallel"]) for w in workers} == {
        "prefill": prefill_tp,
        "decode": decode_tp,
    }
    for worker in workers:  # the other ranks' processes, alive
        pids = _other_ranks(worker)
        assert len(pids) == int(worker.extra["tensor_parallel"]) - 1
        for pid in pids:
            os.kill(pid, 0)
    status = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "status", "--etcd", running.etcd.endpoint, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    shown = {w["role"]: w["ranks"] for w in json.loads(status.stdout)["workers"]}
    for role, ranks in (("prefill", prefill_tp), ("decode", decode_tp)):
        assert [r["rank"] for r in shown[role]] == list(range(ranks))
        assert all(r["device"] == "cpu" and r["rssanon"] > 100 for r in shown[role])


def test_greedy_text_equals_the_engine_and_faults_are_caught(mesh, reference):
    _, running = mesh
    client, errors, answered = client_for(running), [], 0
    for i, topic in enumerate(TOPICS):
        text = f"{LONG} Tell me one fact about {topic}." if i % 3 == 0 else f"One fact: {topic}?"
        messages = [{"role": "user", "content": text}]
        answered += _ask(client, reference, messages, bool(i % 2), errors) is not None
    # turn two holds turn one's answer: the prefill worker reads those pages from decode
    first = [{"role": "user", "content": f"{LONG} Name a colour."}]
    pinned = {"x-session-affinity": "tp-two-turns"}  # both turns on one decode worker
    answer = None
    while answer is None:  # a fault may take the first try
        answer = _ask(client, reference, first, False, errors, pinned)
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And another one?"},
    ]
    while _ask(client, reference, second, True, errors, pinned) is None:
        pass
    workers = _workers(running)
    prefill = next(w for w in workers if w.role == "prefill")
    decoders = [w for w in workers if w.role == "decode"]
    moved = _by_label(prefill.metrics_address, "kvmesh_kv_transfer_bytes_total")
    assert moved.get("prefill:from_decode", 0) > 0, moved  # turn one's answer, read back
    failures = sum(
        metric_sum(w.metrics_address, "kvmesh_kv_integrity_failures_total") for w in decoders
    )
    injected = sum(
        metric_sum(w.metrics_address, "kvmesh_faults_injected_total") for w in [prefill, *decoders]
    )
    assert len(errors) >= 1 and failures == injected >= len(errors)
    assert answered >= len(TOPICS) - 3


def test_sigkill_of_one_rank_takes_its_decode_worker_down_cleanly(mesh):
    (_, decode_tp, _), running = mesh
    if decode_tp == 1:
        pytest.skip("the decode workers of this setup have one rank")
    client = client_for(running)
    for _ in range(3):  # (an injected fault may end a stream before the kill)
        killed = _kill_a_rank_mid_stream(client, running)
        if killed is not None:
            break
    killed_seen = time.monotonic()
    victim, rank, worker_proc, error_after = killed
    print(f"stream error {error_after:.2f} s after the kill")  # (docs/benchmarks.md, with -s)
    assert error_after < 10, "the stream should end with an error within seconds"
    wait_for(
        lambda: victim.worker_id not in {w.worker_id for w in _workers(running)},
        10,
        "the dead worker's lease is revoked",
    )
    print(f"lease gone {error_after + time.monotonic() - killed_seen:.2f} s after the kill")
    assert worker_proc.wait(15) == 1  # the worker went down whole, saying why
    with pytest.raises(ProcessLookupError):
        os.kill(rank, 0)
    others = {w.worker_id for w in _workers(running) if w.role == "decode"} - {victim.worker_id}
    assert others  # the other decode worker still serves
    reply = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content


def _kill_a_rank_mid_stream(client, running):
    """SIGKILL rank 1 of the decode worker serving a stream at its third chunk: (that worker,
    the rank's pid, the worker's process, seconds from the kill to the stream's error)."""
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    killed = None
    try:
        for i, _ in enumerate(stream):
            if i == 2:
                victim = _busy_decode(running)
                rank = _other_ranks(victim)[0]
                killed = (victim, rank, running.procs[victim.worker_id], time.monotonic())
                os.kill(rank, signal.SIGKILL)
    except openai.APIError:
        if killed is None:
            return None
        return (*killed[:3], time.monotonic() - killed[3])
    raise AssertionError("the stream ended without an error")


def _other_ranks(worker) -> list[int]:
    """The pids of a worker's ranks other than rank 0 (its etcd `ranks`)."""
    return [r["pid"] for r in json.loads(worker.extra["ranks"])[1:]]


def _busy_decode(running):
    for worker in _workers(running):
        if worker.role == "decode" and metric_sum(worker.metrics_address, "kvmesh_kv_pages_used"):
            return worker
    raise AssertionError("no decode worker holds pages mid-stream")


def _by_label(address: str, name: str) -> dict[str, float]:
    return {dict(k).get("service", ""): v for k, v in samples(address, name).items()}
