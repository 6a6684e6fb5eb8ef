"""`kvmesh bench coldstart`: from launching `kvmesh up` to the first streamed token.

For each mesh size (P prefill + D decode) and variant, one `kvmesh up` subprocess on a free
port; the bench polls the gateway with a streamed chat request until one yields content (it
does not rely on /health) and then stops the mesh. Phases come from the services' JSON logs
(coldstart_phases); `kvmesh up`'s own marks from its output: `up` parsed (its "starting" line)
and etcd up (its `etcd.started` line). Runs go interleaved (mesh by mesh, every variant), so
variants see the same load. All runs share one $KVMESH_HOME (default: a temporary one whose
models/ links to the real one's) so run folders and the converted-model cache are the bench's.

Variants: cached (converted-model cache warm: primed once before the runs), nocache
(KVMESH_MODEL_CACHE=0), coldcache (an empty cache each run: workers race to fill it),
threads1 (cached, KVMESH_NUM_THREADS=1 in every worker), load1 (cached, one torch thread
while each engine loads: KVMESH_LOAD_THREADS=1), baseline (--baseline-tree: an older
source tree, e.g. `git archive` of a commit, run by this interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvmesh.env import kvmesh_home
from kvmesh_apps.benchmarks import coldstart_phases as phases
from kvmesh_apps.benchmarks.report import BenchRun, write_report

_MARKER = "KVMESH_COLDSTART_RUN"  # in every process of one run's environment
VARIANTS = ("baseline", "nocache", "coldcache", "cached", "threads1", "load1")
_PROMPT = [{"role": "user", "content": "Say hello in one short sentence."}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--meshes", default="1+1,2+2", help="prefill+decode worker counts")
    p.add_argument(
        "--variants",
        default="nocache,coldcache,cached,load1",
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    p.add_argument("--baseline-tree", default="", help="source tree of the baseline variant")
    p.add_argument("--repeats", type=int, default=1, help="runs per mesh and variant")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--up-args", default="", help="more `kvmesh up` flags, e.g. '--dtype bf16'")
    p.add_argument("--home", default="", help="KVMESH_HOME of the runs (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=300.0, help="per run, launch to first token")
    p.add_argument("--output", default=None, help="also write the JSON results here")


def run_coldstart_bench(args: argparse.Namespace) -> int:
    run = BenchRun()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad or ("baseline" in variants and not args.baseline_tree):
        raise SystemExit(f"unknown variants {bad} (baseline needs --baseline-tree)")
    home = Path(args.home) if args.home else _temporary_home()
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVMESH_")}
    report = {**BenchRun.header(), "env": knobs, "home": str(home), "runs": []}
    report["help_s"] = {v: help_seconds(_tree(args, v)) for v in variants}
    if {"cached", "threads1", "load1"} & set(variants):
        report["prime_s"] = prime_cache(args, home)
    for mesh in _meshes(args.meshes):
        for _ in range(args.repeats):
            for variant in variants:
                result = start_once(args, home, mesh, variant)
                result["help_s"] = report["help_s"][variant]
                report["runs"].append(result)
                print(json.dumps(result["summary"] | {"variant": variant}), flush=True)
    if not args.home:
        shutil.rmtree(home / "cache", ignore_errors=True)  # the run logs stay for reading
    report.update(run.footer())
    report["markdown"] = phases.markdown(report["runs"])
    print(report["markdown"])
    write_report(report, args.output)
    return 0


def _meshes(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in part.split("+")) for part in spec.split(",")]  # type: ignore[misc]


def _temporary_home() -> Path:
    home = Path(tempfile.mkdtemp(prefix="kvmesh-coldstart-"))
    (home / "models").symlink_to(kvmesh_home() / "models")  # the fetched models, not a copy
    return home


def _tree(args: argparse.Namespace, variant: str) -> Path | None:
    return Path(args.baseline_tree).resolve() if variant == "baseline" else None


def _env(home: Path, variant: str, tree: Path | None, run_home: Path | None = None) -> dict:
    env = {
        **os.environ,
        "KVMESH_HOME": str(run_home or home),
        "KVMESH_LOG_LEVEL": "INFO",
        "KVMESH_LOG_JSON": "1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }
    if variant == "nocache":
        env["KVMESH_MODEL_CACHE"] = "0"
    if variant == "threads1":
        env["KVMESH_NUM_THREADS"] = "1"
    if variant == "load1":
        env["KVMESH_LOAD_THREADS"] = "1"
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    return env


def help_seconds(tree: Path | None, times: int = 3) -> float:
    """Median wall time of `kvmesh --help` (a fresh interpreter each time)."""
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree else {})}
    walls = []
    for _ in range(times):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "--help"],
            cwd=tree,
            env=env,
            check=True,
            capture_output=True,
        )
        walls.append(time.perf_counter() - start)
    return round(statistics.median(walls), 3)


def prime_cache(args: argparse.Namespace, home: Path) -> float:
    """Fill the caches as the mesh will read them: the converted model and tokenizer (one
    `kvmesh generate`), the config (`kvmesh up` reads it for the KV store's layout)."""
    flags = [f for f in args.up_args.split() if f]
    generate = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "generate",
        "--model",
        args.model,
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        *_engine_flags(flags),
    ]
    config = [
        sys.executable,
        "-c",
        "import sys; from kvmesh.engine.loader import read_config, "
        "resolve_model; read_config(resolve_model(sys.argv[1]))",
        args.model,
    ]
    start = time.perf_counter()
    for cmd in (generate, config):
        subprocess.run(cmd, env=_env(home, "cached", None), check=True, capture_output=True)
    return round(time.perf_counter() - start, 2)


def _engine_flags(flags: list[str]) -> list[str]:
    """The --dtype / --weights pairs of `kvmesh up` flags (they select the cache variant)."""
    out = []
    for i, flag in enumerate(flags[:-1]):
        if flag in ("--dtype", "--weights"):
            out += [flag, flags[i + 1]]
    return out


def start_once(args: argparse.Namespace, home: Path, mesh: tuple[int, int], variant: str):
    from kvmesh.mesh.ports import free_port

    port, tree = free_port(), _tree(args, variant)
    run_home = _coldcache_home(home) if variant == "coldcache" else None
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "up",
        "--model",
        args.model,
        "--prefill",
        str(mesh[0]),
        "--decode",
        str(mesh[1]),
        "--http-port",
        str(port),
        *args.up_args.split(),
    ]
    env = _env(home, variant, tree, run_home) | {_MARKER: uuid.uuid4().hex}
    load = os.getloadavg()[0]  # other work on the box when this run started
    launched = time.time()
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = _Lines(proc.stdout), _Lines(proc.stderr)
    try:
        first = first_token(port, args.model, launched + args.timeout, proc)
    finally:
        _stop(proc, out)
        out.join(), err.join()
        _reap(env[_MARKER])
        if run_home is not None:
            shutil.rmtree(run_home / "cache", ignore_errors=True)  # ~0.5 GB per run
    run_dir = _run_dir(out.lines)
    processes = phases.run_phases(run_dir, launched) if run_dir else []
    up = _up_marks(out.lines, err.lines, launched) | {"first_token_s": _since(first, launched)}
    output = sorted((round(t - launched, 3), line) for t, line in out.lines + err.lines)
    return {
        "mesh": f"{mesh[0]}+{mesh[1]}",
        "variant": variant,
        "run_dir": str(run_dir),
        "loadavg_1m": load,
        "summary": phases.summary(processes, up),
        "processes": phases.process_rows(processes),
        "up_output": output[:60],
    }


def _coldcache_home(home: Path) -> Path:
    run_home = Path(tempfile.mkdtemp(prefix="cold-", dir=home))
    (run_home / "models").symlink_to(kvmesh_home() / "models")
    return run_home


class _Lines:
    """A pipe read on a thread into (arrival time, line) pairs."""

    def __init__(self, pipe: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join(timeout=10)

    def _read(self, pipe: Any) -> None:
        for line in pipe:
            self.lines.append((time.time(), line.rstrip("\n")))


def first_token(port: int, model: str, deadline: float, proc: subprocess.Popen) -> float | None:
    """When (Unix time) a streamed request first yielded content; None if the deadline passed
    or `kvmesh up` exited first."""
    import httpx

    body = {"model": model, "messages": _PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    while time.time() < deadline and proc.poll() is None:
        try:
            with httpx.stream("POST", url, json=body, timeout=30.0) as response:
                if response.status_code == 200 and _has_content(response.iter_lines()):
                    return time.time()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return None


def _has_content(lines: Any) -> bool:
    for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line.removeprefix("data: "))
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                return True
    return False


def _stop(proc: subprocess.Popen, out: _Lines) -> None:
    """SIGINT to `kvmesh up` once it says it is up (an older launcher interrupted while
    starting left its services running), then harder if it hangs."""
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        if any("kvmesh is up" in line for _, line in out.lines):
            break
        time.sleep(0.2)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _reap(marker: str) -> None:
    """SIGKILL whatever this run started that is still alive (found by its environment)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{_MARKER}={marker}".encode() in environ.read_bytes().split(b"\0"):
                os.kill(int(environ.parent.name), signal.SIGKILL)
                print(f"coldstart: killed leftover pid {environ.parent.name}", file=sys.stderr)
        except (OSError, ValueError):
            continue


def _run_dir(stdout: list[tuple[float, str]]) -> Path | None:
    for _, line in stdout:
        found = re.search(r"\(logs in (.+?)\)", line)
        if found:
            return Path(found.group(1))
    return None


def _up_marks(stdout, stderr, launched: float) -> dict[str, float | None]:
    starting = next((t for t, line in stdout if "kvmesh: starting" in line), None)
    logged = phases.json_lines("\n".join(text for _, text in stderr))
    etcd = next((phases.timestamp(e) for e in logged if e.get("event") == "etcd.started"), None)
    return {"cli_s": _since(starting, launched), "etcd_s": _since(etcd, launched)}


def _since(at: float | None, launched: float) -> float | None:
    return None if at is None else round(at - launched, 3)
