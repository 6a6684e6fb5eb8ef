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
    p.add_argument("--kv-cache-mib", type=int, default=512, help="KV page pool budget in MiB")
    p.add_argument("--max-model-len", type=int, default=None)


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
    up = sub.add_parser("up", help="run the local demo (offline engine on a demo chat)")
    _engine_args(up)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    off = bench_sub.add_parser("offline", help="kvmesh vs transformers tokens/s, same weights")
    off.add_argument("--model", default="smollm2-135m")
    off.add_argument("--concurrency", default="1,8,32")
    off.add_argument("--max-tokens", type=int, default=64)
    off.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32,bf16")
    off.add_argument("--no-transformers", action="store_true")
    off.add_argument("--output", default=None, help="also write the JSON results here")
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
        from kvmesh.demo import run_demo

        return run_demo(args.model, args.dtype)
    if args.command == "bench":
        from kvmesh.benchmarks.offline import run_offline_bench

        return run_offline_bench(args)
    return 1


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
        kv_cache_bytes=args.kv_cache_mib << 20,
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
