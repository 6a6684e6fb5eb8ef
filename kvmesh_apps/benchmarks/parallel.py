"""`kvmesh bench parallel`: one model on 1 rank and split over N ranks (tensor parallelism), in
one run: resident memory per rank after the runs, decode tok/s at one stream and at several, and
whether the greedy tokens agree. Then an MoE model of DeepSeek-V3's shape (MLA, shared and
routed experts; random weights unless --moe-model names one) on 1 rank, split inside its
experts over 2 (TP=2) and with its experts partitioned (EP=2).

On a 2-core machine a split cannot be faster: the ranks share the cores (each gets CPUs / N
torch threads) and add two all-reduces per layer. What it shows is the memory split and what
the communication costs a step.
"""

from __future__ import annotations

import argparse
import time

from kvmesh_apps.benchmarks.report import BenchRun, write_report

PROMPT = "Tell me about the history of the city of Paris."
KV_BYTES = 32 << 20  # a small KV pool per rank, so resident memory is mostly weights


def run_parallel_bench(args: argparse.Namespace) -> int:
    import multiprocessing

    run = BenchRun()
    rows, reference = [], None
    # each rank count in a fresh process: memory a finished engine freed stays in a process's
    # heap, and would count against the next one's rank 0
    context = multiprocessing.get_context("spawn")
    runs = [(args.model, layout) for layout in _layouts(args.tensor_parallel)]
    if args.moe_layouts:
        moe = args.moe_model or _random_moe()
        runs += [(moe, layout) for layout in _layouts(args.moe_layouts)]
    for model, layout in runs:
        with context.Pool(1) as pool:
            row, tokens = pool.apply(_measure, ({**vars(args), "model": model}, *layout))
        if model != (rows[-1]["model"] if rows else None):
            reference = tokens  # each model's first layout is its reference
        row["tokens_equal_first"] = tokens == reference
        rows.append(row)
        print(row, flush=True)
    report = {
        **run.header(),
        "dtype": args.dtype,
        "weights": args.weights,
        "max_tokens": args.max_tokens,
        "runs": rows,
    } | run.footer()
    write_report(report, args.output)
    return 0


def _layouts(text: str) -> list[tuple[int, int, bool, int]]:
    """ "1,2,ep2,pp2,pp2/2" -> (tensor ranks, stages, expert parallel, micro-batches) each
    (ppN/M: M micro-batches a step; default 1)."""
    out = []
    for item in text.split(","):
        item, _, micro = item.partition("/")
        number = int(item.removeprefix("ep").removeprefix("pp"))
        layout = (1, number, False) if item.startswith("pp") else (number, 1, item.startswith("ep"))
        out.append((*layout, int(micro or 1)))
    return out


def _random_moe() -> str:
    """A random-weight DeepSeek-V3-shaped checkpoint (~70M parameters: 5 MoE layers of 16
    experts), written once into kvmesh's cache."""
    from kvmesh.env import kvmesh_home
    from kvmesh_apps.tools.tiny_configs import TinySize, TinySpec
    from kvmesh_apps.tools.tiny_models import make_tiny_model

    size = TinySize(
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=512,
        num_layers=6,
        num_heads=8,
        num_experts=16,
    )
    path = kvmesh_home() / "models" / "bench-moe-deepseek-v3"
    if not (path / "config.json").is_file():
        make_tiny_model(TinySpec("deepseek_v3", size=size), path)
    return str(path)


def _measure(
    options: dict, size: int, stages: int, experts: bool, micro: int
) -> tuple[dict, list[int]]:
    """One rank count's row (and its greedy tokens), in a process of its own."""
    from kvmesh import LLM, SamplingParams
    from kvmesh.engine.loader.memory import process_memory_mib

    streams = [int(n) for n in options["concurrency"].split(",")]
    params = SamplingParams(max_tokens=options["max_tokens"], temperature=0.0, ignore_eos=True)
    with LLM(
        model=options["model"],
        dtype=options["dtype"],
        weights=options["weights"],
        max_num_seqs=max(streams),
        tensor_parallel_size=size,
        pipeline_parallel_size=stages,
        enable_expert_parallel=experts,
        pipeline_micro_batches=micro,
        kv_cache_bytes=KV_BYTES,
    ) as llm:
        row = {
            "model": options["model"],
            "tensor_parallel": size,
            "pipeline_parallel": stages,
            "expert_parallel": experts,
            "micro_batches": llm.engine.config.parallel.micro_batches,
            "rank0_weight_mib": round(llm.engine.runner.model.weight_bytes / 2**20, 1),
        }
        for n in streams:
            llm.generate([PROMPT] * n, SamplingParams(max_tokens=4, temperature=0.0))  # warm
            started = time.perf_counter()
            outs = llm.generate([f"{PROMPT} ({i})" for i in range(n)], params)
            seconds = time.perf_counter() - started
            row[f"tok_s_{n}"] = round(sum(len(o.token_ids) for o in outs) / seconds, 2)
        tokens = llm.generate([PROMPT], params)[0].token_ids
        ranks = llm.engine.ranks  # resident memory once every weight has been read
        pids = ["self", *(ranks.pids if ranks else [])]
        memory = [process_memory_mib(pid) for pid in pids]
        for kind in ("rssanon", "rssshmem", "rssfile", "vmhwm"):  # private; KV pages; files; peak
            row[f"{kind}_mib_per_rank"] = [m.get(kind, 0.0) for m in memory]
        return row, tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int4"])
    parser.add_argument(
        "--tensor-parallel",
        default="1,2,pp2,pp2/2",
        help="layouts, in one run: N tensor-parallel ranks, ppN pipeline stages (ppN/M: M "
        "micro-batches a step, default 1)",
    )
    parser.add_argument(
        "--moe-layouts",
        default="1,2,ep2,pp2,pp2/2",
        help="then the MoE model's; epN = N ranks of whole experts ('' to skip)",
    )
    parser.add_argument(
        "--moe-model", default="", help="the MoE model (default: a random DeepSeek-V3-shaped one)"
    )
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", default=None, help="also write the JSON report here")
