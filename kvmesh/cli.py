"""`kvmesh` command line: generate, up, serve, status, bench, train-eagle, make-tiny-model.

Parsing imports no torch, transformers or grpc: each command imports what it runs."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.cli_args import build_parser
from kvmesh.errors import KvmeshError


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
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
    if args.command == "train-eagle":
        return _train_eagle(args)
    if args.command == "make-tiny-model":
        from kvmesh_apps.tools.tiny_cli import run_make_tiny_model

        return run_make_tiny_model(args)
    if args.command == "status":
        from kvmesh.mesh import etcd_access, tls
        from kvmesh.mesh.status import run_status

        tls.configure_from(args)
        etcd_access.configure_from(args)
        return run_status(args.etcd, args.cluster, args.json)
    if args.command == "config":
        from kvmesh.config_show import run_config_show

        return run_config_show(args.argv)
    if args.command == "sim":
        from kvmesh_apps.sim.command import run_sim

        return run_sim(args)
    if args.command == "bench":
        # `kvmesh bench NAME` runs kvmesh_apps.benchmarks.NAME.run_NAME_bench (serve's agent workload
        # is the agent bench)
        bench = "agent" if getattr(args, "workload", "") == "agent" else args.bench
        bench = bench.replace("-", "_")  # agent-api -> agent_api
        module = importlib.import_module(f"kvmesh_apps.benchmarks.{bench}")
        return getattr(module, f"run_{bench}_bench")(args)
    return 1


def _up(args: argparse.Namespace) -> int:
    if args.demo:
        from kvmesh_apps.demo import run_demo

        return run_demo(args.model, args.dtype)
    from kvmesh.mesh.up_command import run_up
    from kvmesh.mesh.up_config import up_options

    options = up_options(args)
    for worker in options.workers.values():
        _check_device(worker.engine.device.device)
    return run_up(options)


def _serve(args: argparse.Namespace) -> int:
    from kvmesh import event_loop
    from kvmesh.log import configure_logging
    from kvmesh.mesh import etcd_access, tls, tracing

    configure_logging(args.service, "INFO")
    tls.configure_from(args)
    etcd_access.configure_from(args)
    tracing.setup(args.service)
    try:
        serve, options = _service(args)
    except ValueError as exc:  # flags that do not go together: argparse's exit, no traceback
        print(f"kvmesh serve {args.service}: error: {exc}", file=sys.stderr)
        return 2
    _log_imports_done()
    from kvmesh.mesh import transfer

    transfer.end_with_process()  # the process exits after serving: no ~1 s TE destructor
    code = event_loop.run(serve(options)) or 0
    if transfer.parked():
        from kvmesh.processes import exit_now

        exit_now(code)
    return code


def _service(args: argparse.Namespace) -> tuple[Callable[[Any], Any], Any]:
    """The service's serve coroutine (importing it: torch and all for a worker) and options."""
    from kvmesh.config.flags import from_namespace

    if args.service == "kvstore":
        from kvmesh.config.kvstore import KVStoreConfig
        from services.kvstore.main import checked, serve_kvstore

        return serve_kvstore, checked(from_namespace(KVStoreConfig, args))
    if args.service == "draft":
        from kvmesh.config.draft import DraftConfig
        from services.draft.main import check_addresses, serve_draft

        config = from_namespace(DraftConfig, args)
        check_addresses(config)
        return serve_draft, config
    if args.service == "gateway":
        from kvmesh.agent.tool_parsers import PARSERS
        from kvmesh.config.gateway import GatewayConfig
        from services.gateway.main import serve_gateway

        config = from_namespace(GatewayConfig, args)
        if not config.service.etcd:
            raise ValueError("--etcd is required (or a --config that has it)")
        parser = config.api.tool_call_parser
        if parser and parser not in PARSERS:
            raise ValueError(f"--tool-call-parser {parser!r}: one of {', '.join(sorted(PARSERS))}")
        return serve_gateway, config
    from kvmesh.config import WorkerConfig
    from kvmesh.mesh.worker_runtime import transfer_config

    if args.service == "prefill":
        from services.prefill.main import serve_prefill as serve
    else:
        from services.decode.main import serve_decode as serve
    config = from_namespace(WorkerConfig, args, role=args.service)
    if not config.service.etcd:
        raise ValueError("--etcd is required (or a --config that has it)")
    transfer_config(config)  # the addresses and NICs checked before anything loads
    _check_device(config.engine.device.device)
    return serve, config


def _check_device(device: str) -> None:
    """`--device cuda` where it cannot run: one line and exit 2, before anything loads."""
    if device != "cpu":
        from kvmesh.engine.platform import resolve

        resolve(device)


def _log_imports_done() -> None:
    """A start-up phase mark for `kvmesh bench coldstart`: when the process was exec'd and
    when its imports were done (this line's timestamp)."""
    import time

    import structlog

    now = time.time()
    exec_at = _exec_time(now)
    imports_s = None if exec_at is None else round(now - exec_at, 3)
    structlog.get_logger(__name__).info(
        "process.imports_done", exec_at=exec_at, imports_s=imports_s
    )


def _exec_time(now: float) -> float | None:
    """This process's start as a Unix time (Linux /proc: 10 ms ticks), None elsewhere."""
    from pathlib import Path

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(now - (uptime - ticks / os.sysconf("SC_CLK_TCK")), 3)


def _generate(args: argparse.Namespace) -> int:
    from kvmesh import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=tuple(args.stop),
    )
    from kvmesh.config import EngineConfig
    from kvmesh.config.flags import from_namespace
    from kvmesh.config.knobs import flat

    config = from_namespace(EngineConfig, args)
    _check_device(config.device.device)
    llm = LLM(**flat(config))
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


def _train_eagle(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvmesh.engine.spec.eagle_train import TrainOptions, train

    options = TrainOptions(
        model=args.model,
        output=Path(args.output),
        epochs=args.epochs,
        max_tokens=args.max_tokens,
        samples_per_prompt=args.samples_per_prompt,
        draft_vocab=args.draft_vocab,
        limit_prompts=args.limit_prompts,
    )
    print(json.dumps(train(options)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
