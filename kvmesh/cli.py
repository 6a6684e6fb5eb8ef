"""`kvmesh` command line: generate, chat, up (demo), bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvmesh.errors import KvmeshError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="smollm2-135m", help="alias, .gguf file or HF safetensors folder"
    )
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    _kv_args(p)
    p.add_argument("--max-model-len", type=int, default=None)


def _size(text: str) -> int:
    from kvmesh.engine.kv.layout import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp8_e4m3"],
        help="KV page storage (auto: the model dtype; fp8_e4m3: half of BF16's bytes)",
    )
    p.add_argument(
        "--kv-cache-memory",
        dest="kv_cache_bytes",
        type=_size,
        default=512 << 20,
        metavar="SIZE",
        help="KV page pool budget, e.g. 256MiB or 2GiB (default 512MiB)",
    )
    p.add_argument(
        "--kv-cache-mib",
        dest="kv_cache_bytes",
        type=lambda mib: int(mib) << 20,
        help="the same budget in MiB (older spelling)",
    )
    p.add_argument(
        "--kv-integrity",
        default="on",
        choices=["on", "off"],
        help="check every KV page's integrity tag before each step (default on)",
    )


def _mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    p.add_argument("--cluster", default="default")
    p.add_argument("--host", default="127.0.0.1")


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    _kv_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--protocol", default="tcp", choices=["tcp", "rdma"], help="transfer engine protocol"
    )
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="decode prefills prompts up to this many tokens itself",
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with the in-process engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user chat message")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _engine_args(gen)
    _sampling_args(gen)
    up = sub.add_parser("up", help="run the local mesh: etcd, gateway, prefill and decode workers")
    up.add_argument("--model", default="smollm2-135m")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--http-port", type=int, default=None)
    up.add_argument("--grpc-port", type=int, default=None)
    up.add_argument("--cluster", default="default")
    up.add_argument(
        "--demo", action="store_true", help="run the offline engine on a demo chat instead"
    )
    up.add_argument("--routing", default="cache-aware", choices=["cache-aware", "least-load"])
    up.add_argument(
        "--kvstore",
        default="builtin",
        choices=["builtin", "mooncake", "none"],
        help="start the KV store service (RAM + disk tiers; mooncake: RAM + Mooncake Store "
        "via mooncake_master) or run without one",
    )
    up.add_argument("--kvstore-ram-mib", type=int, default=256)
    up.add_argument("--kvstore-disk-mib", type=int, default=1024)
    up.add_argument("--session-ttl", type=int, default=600)
    _worker_args(up)
    serve = sub.add_parser("serve", help="run one service of the mesh")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for role in ("prefill", "decode"):
        worker = serve_sub.add_parser(role)
        _mesh_args(worker)
        worker.add_argument("--model", default="smollm2-135m")
        worker.add_argument("--worker-id", default="")
        worker.add_argument("--port", type=int, default=0)
        worker.add_argument("--metrics-port", type=int, default=0)
        _worker_args(worker)
    from services.kvstore.main import add_arguments as kvstore_arguments

    kvstore_arguments(serve_sub.add_parser("kvstore", help="the KV page store (RAM + disk tiers)"))
    gateway = serve_sub.add_parser("gateway")
    _mesh_args(gateway)
    gateway.add_argument("--model", default="smollm2-135m")
    gateway.add_argument("--http-port", type=int, default=8000)
    gateway.add_argument("--grpc-port", type=int, default=0)
    gateway.add_argument("--session-ttl", type=int, default=600, help="x-session-affinity TTL (s)")
    gateway.add_argument(
        "--affinity-max-load-ratio",
        type=float,
        default=2.0,
        help="affinity yields when the pinned worker's load exceeds this many times the least "
        "loaded one's, plus --affinity-slack-tokens",
    )
    gateway.add_argument("--affinity-slack-tokens", type=int, default=2048)
    gateway.add_argument(
        "--routing",
        default="cache-aware",
        choices=["cache-aware", "least-load"],
        help="cache-aware: session affinity + prefix scores; least-load: baseline",
    )
    status = sub.add_parser("status", help="list the mesh's workers and their load")
    status.add_argument(
        "--etcd", default=None, help="host:port (default: the one `kvmesh up` started)"
    )
    status.add_argument("--cluster", default=None)
    status.add_argument("--json", action="store_true")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    off = bench_sub.add_parser("offline", help="kvmesh vs transformers tokens/s, same weights")
    off.add_argument("--model", default="smollm2-135m")
    off.add_argument("--concurrency", default="1,8,32")
    off.add_argument("--max-tokens", type=int, default=64)
    off.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32,bf16")
    off.add_argument("--no-transformers", action="store_true")
    off.add_argument("--output", default=None, help="also write the JSON results here")
    from kvmesh.benchmarks.transfer import add_arguments as transfer_arguments

    transfer_arguments(
        bench_sub.add_parser("transfer", help="Mooncake TE vs gRPC bytes for KV pages")
    )
    from kvmesh.benchmarks import agent as agent_bench
    from kvmesh.benchmarks.serve import add_arguments as serve_arguments

    serve_bench = bench_sub.add_parser(
        "serve", help="TTFT/TPOT/tok/s through the mesh vs the engine"
    )
    serve_bench.add_argument(
        "--workload",
        default="chat",
        choices=["chat", "agent"],
        help="agent: multi-turn sessions (see `kvmesh bench agent`)",
    )
    serve_arguments(serve_bench)
    agent_bench.add_workload_arguments(serve_bench)
    agent_bench.add_arguments(
        bench_sub.add_parser(
            "agent", help="multi-turn agent sessions: cache-aware vs least-load routing"
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvmesh.log import configure_logging

    configure_logging("cli")
    try:
        return _dispatch(args)
    except KvmeshError as exc:
        if not exc.user_error:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command == "up":
        return _up(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        from kvmesh.mesh.status import run_status

        return run_status(args.etcd, args.cluster, args.json)
    if args.command == "bench":
        if args.bench == "agent" or (args.bench == "serve" and args.workload == "agent"):
            from kvmesh.benchmarks.agent import run_agent_bench

            return run_agent_bench(args)
        if args.bench == "serve":
            from kvmesh.benchmarks.serve import run_serve_bench

            return run_serve_bench(args)
        if args.bench == "transfer":
            from kvmesh.benchmarks.transfer import run_transfer_bench

            return run_transfer_bench(args)
        from kvmesh.benchmarks.offline import run_offline_bench

        return run_offline_bench(args)
    return 1


_WORKER_FLAGS = ("dtype", "kv_dtype", "kv_cache_bytes", "kv_integrity", "max_num_seqs", "protocol",
                 "local_prefill_tokens")  # fmt: skip


def _worker_passthrough(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for name in _WORKER_FLAGS:
        flag = "--kv-cache-memory" if name == "kv_cache_bytes" else f"--{name.replace('_', '-')}"
        flags += [flag, str(getattr(args, name))]
    return flags


def _up(args: argparse.Namespace) -> int:
    if args.demo:
        from kvmesh.demo import run_demo

        return run_demo(args.model, args.dtype)
    from kvmesh.mesh.launcher import UpOptions, run_up

    passthrough = _worker_passthrough(args)
    return run_up(
        UpOptions(
            model=args.model,
            prefill=args.prefill,
            decode=args.decode,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            cluster=args.cluster,
            worker_args=tuple(passthrough),
            gateway_args=("--routing", args.routing, "--session-ttl", str(args.session_ttl)),
            kvstore=args.kvstore,
            kvstore_args=(
                "--ram-mib",
                str(args.kvstore_ram_mib),
                "--disk-mib",
                str(args.kvstore_disk_mib),
            ),
        )
    )


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from kvmesh.log import configure_logging

    configure_logging(args.service, "INFO")
    if args.service == "kvstore":
        from services.kvstore.main import options_from_args, serve_kvstore

        asyncio.run(serve_kvstore(options_from_args(args)))
        return 0
    if args.service == "gateway":
        from services.gateway.main import GatewayOptions, serve_gateway

        asyncio.run(
            serve_gateway(
                GatewayOptions(
                    etcd=args.etcd,
                    cluster=args.cluster,
                    model=args.model,
                    host=args.host,
                    http_port=args.http_port,
                    grpc_port=args.grpc_port,
                    session_ttl=args.session_ttl,
                    affinity_max_load_ratio=args.affinity_max_load_ratio,
                    affinity_slack_tokens=args.affinity_slack_tokens,
                    routing=args.routing,
                )
            )
        )
        return 0
    from kvmesh.mesh.worker_runtime import WorkerOptions

    options = WorkerOptions(
        role=args.service,
        etcd=args.etcd,
        cluster=args.cluster,
        worker_id=args.worker_id,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        model=args.model,
        **{name: getattr(args, name) for name in _WORKER_FLAGS if name != "kv_integrity"},
        kv_integrity=args.kv_integrity == "on",
    )
    if args.service == "prefill":
        from services.prefill.main import serve_prefill as serve
    else:
        from services.decode.main import serve_decode as serve
    asyncio.run(serve(options))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvmesh import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_dtype=args.kv_dtype,
        kv_integrity=args.kv_integrity == "on",
        max_model_len=args.max_model_len,
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    if not args.json:
        print(out.text)
        return 0
    print(
        json.dumps(
            {
                "text": out.text,
                "token_ids": out.token_ids,
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(out.token_ids),
                "cached_tokens": out.num_cached_tokens,
                "finish_reason": out.finish_reason,
                "ttft_s": round(out.ttft_s, 4),
                "decode_tokens_per_s": round(out.decode_tokens_per_s, 2),
                "model": llm.engine.model_name,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
