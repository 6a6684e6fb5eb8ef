"""`kvmesh bench chaos`: streams under load while the mesh is broken on purpose -- decode and
prefill workers SIGKILLed and SIGSTOPped, etcd restarted, the KV store killed, and (through
KVMESH_FAULTS in every worker) transfers dropped and pages overwritten. Every request must end
with the fault-free engine's text or a clear error; afterwards no worker holds a page and no
process outlives the mesh. Reports outcomes, recovery times and what was injected."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvmesh_apps.benchmarks.report import BenchRun, write_report

TOPICS = [
    f"Tell me a short story about {t}."
    for t in (
        "a lighthouse",
        "a fox",
        "the sea",
        "a clock",
        "a train",
        "rain",
        "a garden",
        "snow",
        "a violin",
        "a kite",
        "an owl",
        "a bridge",
        "the moon",
        "a desert",
        "a ship",
        "a forest",
    )
]
FAULTS = (
    "kill:decode",
    "stop:prefill",
    "kill:kvstore",
    "restart:etcd",
    "kill:prefill",
    "stop:decode",
)
STOP_S = 3.0  # how long a SIGSTOPped worker stays stopped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--fault-every", type=float, default=10.0, help="seconds between faults")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--page-faults",
        default="drop_transfer@9,overwrite@60",
        help="KVMESH_FAULTS of every worker ('' for none)",
    )
    parser.add_argument("--output", default=None, help="also write the JSON results here")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # exact | wrong_text | error:<code>
    completed_at: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome == "exact":
                self.completed_at.append(time.monotonic())

    def first_success_after(self, moment: float) -> float | None:
        with self.lock:
            return next((t - moment for t in self.completed_at if t > moment), None)


def run_chaos_bench(args: argparse.Namespace) -> int:
    from kvmesh.mesh.launcher import Mesh, UpOptions
    from kvmesh.mesh.supervisor import RestartPolicy
    from kvmesh.mesh.up_config import worker_configs

    expected = expected_texts(args)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    saved = dict(os.environ)
    os.environ["KVMESH_FAULTS"] = args.page_faults
    run = BenchRun()
    mesh = Mesh(
        UpOptions(
            workers=worker_configs(
                "--model", args.model, "--kv-cache-mib", "96", "--max-num-seqs", "32"
            ),
            prefill=1,
            decode=2,
            kvstore="builtin",
        )
    )
    mesh.supervisor.policy = RestartPolicy(max_restarts=1000, backoff_s=0.2)
    seen: set[int] = set()
    try:
        mesh.start()
        os.environ.clear()
        os.environ.update(saved)
        tally, faults = Tally(), []
        stop = threading.Event()
        with ThreadPoolExecutor(args.streams) as pool:
            loops = [
                pool.submit(load_loop, mesh.url, args, expected, tally, stop, k)
                for k in range(args.streams)
            ]
            faults = _break_things(mesh, args, tally, seen)
            stop.set()
            for loop in loops:
                loop.result()
        pages = _settled_pages(mesh)
        injected = _injected(mesh)
        for fault in faults:  # requests completing after it: the mesh serves again
            first = tally.first_success_after(fault.pop("moment"))
            fault["next_success_s"] = None if first is None else round(first, 2)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        seen.update(mesh.pids().values())
        mesh.stop()
    orphans = [pid for pid in seen if pid and _alive(pid)]
    report = {
        **run.header(),
        "streams": args.streams,
        "duration_s": args.duration,
        "outcomes": dict(tally.outcomes),
        "faults": faults,
        "page_faults_injected": injected,
        "pages_in_use_after": pages,
        "orphan_processes": orphans,
    } | run.footer()
    print({k: report[k] for k in ("outcomes", "pages_in_use_after", "orphan_processes")})
    write_report(report, args.output)
    clean = tally.outcomes["wrong_text"] == 0 and not any(pages.values()) and not orphans
    return 0 if clean else 1


def expected_texts(args: argparse.Namespace) -> dict[str, str]:
    from kvmesh import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(args.model, dtype="fp32", kv_cache_bytes=64 << 20) as llm:
        outs = llm.chat([[{"role": "user", "content": t}] for t in TOPICS], params)
    return {topic: out.text for topic, out in zip(TOPICS, outs, strict=True)}


def load_loop(
    url: str, args, expected: dict[str, str], tally: Tally, stop: threading.Event, offset: int
) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for i in itertools.count(offset):
        if stop.is_set():
            return
        topic = TOPICS[i % len(TOPICS)]
        try:
            stream = client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": topic}],
                stream=True,
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            tally.add("exact" if text == expected[topic] else "wrong_text")
        except openai.APIError as exc:
            code = getattr(exc, "code", None) or type(exc).__name__
            tally.add(f"error:{code}")
            time.sleep(0.2)  # a client backs off


def _break_things(mesh, args, tally: Tally, seen: set[int]) -> list[dict]:
    """One fault every --fault-every seconds until --duration; the supervisor restarts what
    was killed. Returns each fault with its recovery times."""
    faults, started = [], time.monotonic()
    for kind in itertools.cycle(FAULTS):
        _watch(mesh, seen, args.fault_every)
        if time.monotonic() - started > args.duration:
            return faults
        action, target = kind.split(":")
        before = _addresses(mesh, target)
        moment = time.monotonic()
        if target == "etcd":
            mesh.etcd.restart()
        else:
            name = next(n for n in mesh.procs if n.startswith(target))
            proc = mesh.procs[name]
            if action == "kill":
                os.kill(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGSTOP)
                _watch(mesh, seen, STOP_S)
                os.kill(proc.pid, signal.SIGCONT)
        back = _until_registered(mesh, seen, target, before) if action == "kill" else None
        faults.append(
            {
                "fault": kind,
                "at_s": round(moment - started, 1),
                "moment": moment,
                "registered_again_s": back,
            }
        )
        print(faults[-1], flush=True)


def _watch(mesh, seen: set[int], seconds: float) -> None:
    """Let the supervisor restart what died, for `seconds`; remember every pid."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        mesh.supervisor.check()
        seen.update(mesh.pids().values())
        time.sleep(0.1)


def _addresses(mesh, role: str) -> set[str]:
    """The gRPC addresses `role` services registered (a restarted one listens on a new port)."""
    from kvmesh.mesh.launcher import list_workers

    try:
        return {
            w.grpc_address
            for w in asyncio.run(list_workers(mesh.etcd.endpoint, "default"))
            if w.role == role
        }
    except Exception:  # noqa: BLE001 - etcd may be restarting
        return set()


def _until_registered(
    mesh, seen: set[int], role: str, before: set[str], limit_s: float = 120.0
) -> float | None:
    """Seconds until the killed `role` service registered again (under a new address)."""
    begun = time.monotonic()
    while time.monotonic() - begun < limit_s:
        _watch(mesh, seen, 0.2)
        if _addresses(mesh, role) - before:
            return round(time.monotonic() - begun, 2)
    return None


def _settled_pages(mesh, limit_s: float = 60.0) -> dict[str, int]:
    """KV pages each worker holds once the load is gone (waits up to `limit_s` for 0)."""
    from kvmesh.mesh.status import _collect

    end = time.monotonic() + limit_s
    while True:
        workers = asyncio.run(_collect(mesh.etcd.endpoint, "default"))
        used = {w["id"]: int((w["load"] or {}).get("kvPagesUsed", 0)) for w in workers}
        if not any(used.values()) or time.monotonic() > end:
            return used
        time.sleep(0.5)


def _injected(mesh) -> float:
    from kvmesh.mesh.launcher import list_workers
    from kvmesh.mesh.metrics_probe import metric_sum

    workers = asyncio.run(list_workers(mesh.etcd.endpoint, "default"))
    return sum(
        metric_sum(w.metrics_address, "kvmesh_faults_injected_total")
        for w in workers
        if w.role in ("prefill", "decode")
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False
