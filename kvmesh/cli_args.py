"""The `kvmesh` argument parser (kept apart from the dispatch in cli.py)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.config import WorkerConfig
from kvmesh.config.draft import DraftConfig
from kvmesh.config.gateway import GatewayConfig
from kvmesh.config.kvstore import KVStoreConfig
from kvmesh.routing import UP_LOCAL_PREFILL_TOKENS
from kvmesh_apps.tools import tiny_cli  # imports no torch


def _engine_flags(p: argparse.ArgumentParser, **kwargs) -> None:
    """Every engine knob (kvmesh/config/engine.py) as a flag."""
    from kvmesh.config.engine import EngineConfig
    from kvmesh.config.flags import add_flags

    add_flags(p, EngineConfig, **kwargs)


def _service_flags(p: argparse.ArgumentParser, root: type, skip: tuple[str, ...] = ()) -> None:
    """`kvmesh serve NAME`: the service's whole config tree as flags, `--config FILE` (its
    JSON, as `kvmesh config show` prints it and `kvmesh up` writes it: flags after it win), and
    the process's TLS and etcd access."""
    from kvmesh.config.flags import ConfigFile, add_flags

    p.add_argument(
        "--config",
        action=ConfigFile,
        root=root,
        default=None,
        help="the service's config as JSON; flags after it win",
    )
    add_flags(p, root, skip=skip, defaults=_tls_defaults())


def _tls_defaults() -> dict[str, str]:
    """--tls-cert / --tls-key / --tls-ca default to $KVMESH_TLS_CERT / _KEY / _CA (a container
    sets them once for its service and its health check)."""
    from kvmesh.env import tls_paths

    paths = [path or "" for path in tls_paths()]
    return dict(zip(("tls_cert", "tls_key", "tls_ca"), paths, strict=True))


def _up_worker_flags(p: argparse.ArgumentParser) -> None:
    """`kvmesh up`: the gateway's knobs (but where it runs), the engine's and how workers serve
    and move pages, for every worker."""
    from kvmesh.config.flags import add_flags
    from kvmesh.config.gateway import GatewayConfig
    from kvmesh.config.placement import TransferKnobs
    from kvmesh.config.worker import ServingConfig

    add_flags(p, GatewayConfig, skip=("etcd", "cluster", "host", "http_port", "grpc_port", "model"))
    _engine_flags(p, notes={"tensor_parallel_size": "; per role: --prefill-tp / --decode-tp"})
    add_flags(p, TransferKnobs)
    auto = f" (default {UP_LOCAL_PREFILL_TOKENS}, 0 with --prefill-weights / --decode-weights)"
    add_flags(
        p,
        ServingConfig,
        skip=("use_kvstore",),
        defaults={"local_prefill_tokens": None},
        notes={"local_prefill_tokens": auto},
    )


def _up_flags(up: argparse.ArgumentParser) -> None:
    """`kvmesh up`: what the mesh is made of, the KV store's tiers, then every worker's knobs
    and each role's own."""
    from kvmesh.config.flags import add_flags
    from kvmesh.config.kvstore import Tiers
    from kvmesh.config.up import MeshConfig, RoleOverrides

    add_flags(up, MeshConfig)
    add_flags(up, Tiers, skip=("backend", "mooncake_master"), prefix="kvstore")
    _up_worker_flags(up)
    for role in ("prefill", "decode"):
        add_flags(up, RoleOverrides, prefix=role)
        _cpus_arg(
            up,
            f"--{role}-cpus",
            f"KVMESH_{role.upper()}_CPUS",
            f"pin every {role} worker to these CPUs, a torch thread per CPU",
        )


def _cpus_arg(p: argparse.ArgumentParser, flag: str, env_name: str, text: str) -> None:
    from kvmesh.mesh.affinity import ExportCpus  # no torch, no structlog: parsing stays fast

    p.add_argument(
        flag,
        action=ExportCpus,
        env_name=env_name,
        default=None,
        metavar="LIST",
        help=f"{text} (e.g. 0, 0-1, 0,2-3; exported as {env_name})",
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command line, only the sub-command it names gets the
    arguments defined in other modules (some import torch or grpc: `kvmesh --help` and every
    other command must not pay for them)."""
    lazy = _Lazy(None if argv is None else tuple(argv))
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: a mesh for serving LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with the in-process engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user chat message")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _engine_flags(gen)
    _sampling_args(gen)
    up = sub.add_parser("up", help="run the local mesh: etcd, gateway, prefill and decode workers")
    _up_flags(up)
    serve = sub.add_parser("serve", help="run one service of the mesh")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for role in ("prefill", "decode"):
        worker = serve_sub.add_parser(role, help=f"a {role} worker")
        _service_flags(worker, WorkerConfig, () if role == "decode" else ("delivery_port",))
        _cpus_arg(
            worker,
            "--cpus",
            "KVMESH_CPUS",
            "pin this worker to these CPUs; torch "
            "threads = their number unless KVMESH_NUM_THREADS says otherwise",
        )
    store = serve_sub.add_parser("kvstore", help="the KV page store (RAM + disk tiers)")
    _service_flags(store, KVStoreConfig)
    draft = serve_sub.add_parser("draft", help="the EAGLE draft service")
    _service_flags(draft, DraftConfig)
    train = sub.add_parser("train-eagle", help="self-distil an EAGLE draft head on CPU")
    train.add_argument("--model", default="smollm2-135m")
    train.add_argument("--output", required=True, help="where to write the head (safetensors)")
    train.add_argument("--epochs", type=int, default=6)
    train.add_argument("--max-tokens", type=int, default=112, help="answer length per prompt")
    train.add_argument("--samples-per-prompt", type=int, default=2, help="greedy + sampled")
    train.add_argument("--draft-vocab", type=int, default=4096)
    train.add_argument("--limit-prompts", type=int, default=0, help="0: all training prompts")
    gateway = serve_sub.add_parser("gateway", help="the gateway (REST and gRPC fronts, router)")
    _service_flags(gateway, GatewayConfig)
    status = sub.add_parser("status", help="list the mesh's workers and their load")
    status.add_argument(
        "--etcd", default=None, help="host:port (default: the one `kvmesh up` started)"
    )
    status.add_argument("--cluster", default=None)
    status.add_argument("--json", action="store_true")
    from kvmesh.config.flags import add_flags
    from kvmesh.config.placement import Placement

    add_flags(status, Placement, skip=("etcd", "cluster", "host"), defaults=_tls_defaults())
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    off = bench_sub.add_parser("offline", help="kvmesh vs transformers tokens/s, same weights")
    off.add_argument("--model", default="smollm2-135m")
    off.add_argument("--concurrency", default="1,8,32")
    off.add_argument("--max-tokens", type=int, default=64)
    off.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32,bf16")
    off.add_argument("--no-transformers", action="store_true")
    off.add_argument("--output", default=None, help="also write the JSON results here")
    _bench_args(bench_sub, lazy)
    sim = sub.add_parser("sim", help="the fleet on a simulated clock, on the gateway's router")
    sim_sub = sim.add_subparsers(dest="sim", required=True)
    for name, text in _SIMS.items():
        lazy.add(sim_sub, ("sim", name), text, "kvmesh_apps.sim.command", f"add_{name}_arguments")
    config = sub.add_parser("config", help="the effective config of a command")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the config a command would run with, as JSON (for `up`: every child's)",
        description="e.g. kvmesh config show up --decode-tp 2 --kv-dtype fp8_e4m3",
    )
    show.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its flags")
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random HF checkpoint for tests")
    tiny_cli.add_arguments(tiny)
    return parser


_BENCHES = {  # name: (help, module whose add_arguments defines its flags)
    "transfer": ("Mooncake TE vs gRPC bytes for KV pages", "kvmesh_apps.benchmarks.transfer"),
    "kv": (
        "FP8 vs BF16 KV throughput at one memory budget, integrity-check cost, FP8 quality",
        "kvmesh_apps.benchmarks.kv",
    ),
    "weights": (
        "INT4 vs bf16 vs fp32 weights: memory, decode tok/s, quality",
        "kvmesh_apps.benchmarks.weights",
    ),
    "spec": ("tokens/s with and without speculative decoding", "kvmesh_apps.benchmarks.spec"),
    "serve": (
        "TTFT/TPOT/tok/s of any OpenAI-compatible server (--url), or the mesh vs the engine",
        "kvmesh.cli_args",
    ),
    "agent": (
        "multi-turn agent sessions: cache-aware vs least-load routing",
        "kvmesh_apps.benchmarks.agent",
    ),
    "coldstart": (
        "`kvmesh up` to the first streamed token, split by phase",
        "kvmesh_apps.benchmarks.coldstart",
    ),
    "pd": (
        "steady decode streams + long prompts: colocated vs disaggregated P/D, pinned cores",
        "kvmesh_apps.benchmarks.pd",
    ),
    "kernels": (
        "the CPU kernels vs torch and vs the memory-read ceiling measured in the run",
        "kvmesh_apps.benchmarks.kernels",
    ),
    "step": (
        "a decode step split into model compute and host work, per concurrency",
        "kvmesh_apps.benchmarks.step",
    ),
    "compiled": (
        "the compiled decode step vs the eager one, side by side in one engine",
        "kvmesh_apps.benchmarks.compiled",
    ),
    "agent-api": (
        "grammar cost per step, cold vs cached grammar TTFT, EAGLE on JSON with grammar",
        "kvmesh_apps.benchmarks.agent_api",
    ),
    "parallel": (
        "one model on 1 rank vs split over N (tensor parallel): memory per rank, tok/s",
        "kvmesh_apps.benchmarks.parallel",
    ),
    "fuzz": (
        "schemathesis over the gateway's OpenAPI document + hypothesis over every gRPC "
        "service, on a live mesh",
        "kvmesh_apps.benchmarks.fuzz",
    ),
    "chaos": (
        "streams under load while workers, etcd and the KV store are killed / stopped and "
        "pages dropped or corrupted",
        "kvmesh_apps.benchmarks.chaos",
    ),
    "overload": (
        "a mesh at its capacity, then 4x: 429s with Retry-After, TPOT of the accepted, RSS",
        "kvmesh_apps.benchmarks.overload",
    ),
    "soak": (
        "many streams for a long time: errors, and the slopes of RSS, file descriptors and "
        "pages after warm-up",
        "kvmesh_apps.benchmarks.soak",
    ),
}


_SIMS = {
    "run": "a fleet and a workload, routing policies side by side",
    "claims": "the seeds' claims at peak load: hit ratio by routing, p90 TPOT colocated "
    "round-robin vs disaggregated",
    "sweep": "the same load per worker on 1 to 1,000 workers",
    "calibrate": "fit the cost model to a mesh started on this machine",
    "check": "the simulator against a mesh on this machine: same workload, figures compared",
}


def _bench_args(bench_sub, lazy: _Lazy) -> None:
    for name, (text, module) in _BENCHES.items():
        adder = "add_serve_bench_arguments" if name == "serve" else "add_arguments"
        lazy.add(bench_sub, ("bench", name), text, module, adder)


def add_serve_bench_arguments(p: argparse.ArgumentParser) -> None:
    """`kvmesh bench serve`: the serve bench's flags plus the agent workload's."""
    from kvmesh_apps.benchmarks import agent, serve

    p.add_argument(
        "--workload",
        default="chat",
        choices=["chat", "agent"],
        help="agent: multi-turn sessions (see `kvmesh bench agent`)",
    )
    serve.add_arguments(p)
    agent.add_workload_arguments(p)


@dataclass(frozen=True)
class _Lazy:
    """Sub-parsers whose arguments live in another module, imported only when `argv` (None:
    always) names the command and that sub-command."""

    argv: tuple[str, ...] | None

    def add(
        self, sub, path: tuple[str, str], text: str, module: str, adder: str = "add_arguments"
    ) -> None:
        """`sub.add_parser(path[1])`, filled by `module.adder` if argv starts with `path`."""
        parser = sub.add_parser(path[1], help=text, description=text)
        if self.argv is None or self.argv[:2] == path:
            getattr(importlib.import_module(module), adder)(parser)
