"""`kvmesh bench kernels`: the CPU kernels against torch and against the machine's ceiling.

All in one process and one run, each pair timed back to back (best of `--repeats`):
- the memory-read ceiling: the faster of torch's fp32 GEMV and the bf16 GEMV kernel at one row
  over 256 MiB of weights (torch's reached ~20 GB/s on the AVX-512 EPYC, the kernel 34-43),
  in GB/s;
- one token's worth of SmolLM2-135M linears (30 layers of q|k|v, o, gate|up, down + the LM head,
  distinct tensors so they come from DRAM) at 1-64 rows: bf16 through the GEMV kernel, the AMX
  kernel (where it runs) and torch's F.linear, INT4 through the kernel vs
  `_weight_int4pack_mm_for_cpu`, as GB/s of weight bytes and as a fraction of the ceiling, and
  bf16 as GFLOP/s against the compute ceiling: torch's bf16 GEMM at 512 rows over the same
  weights (what a large batch reaches here);
- decode attention over pages at B streams x L tokens (SmolLM2's 3 KV heads x 64, bf16 and FP8
  pages, bf16 compute, one pool per layer for `--layers` layers visited in turn, so the pages
  come from DRAM as in a real step): the paged kernel vs the torch backend (gather + grouped
  matmuls), ms per layer and the ratio;
- bf16 RMSNorm of one row: kernel vs torch, microseconds.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from functools import partial

import torch

from kvmesh.errors import InvalidRequestError
from kvmesh_apps.benchmarks.report import BenchRun, write_report

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M, per layer
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def ceiling(repeats: int) -> float:
    """GB/s of the fastest weight stream measured over 256 MiB: torch's fp32 GEMV, or the bf16
    GEMV kernel at one row where it loads (it prefetches into L2 and read 1.7x torch's GB/s on
    the AVX-512 EPYC): how fast this machine streams weights from memory."""
    return Ceiling(repeats)()


class Ceiling:
    """`ceiling` as a probe to call many times: its 256 MiB operands are made once."""

    def __init__(self, repeats: int = 5) -> None:
        from kvmesh.engine.kernels import cpu_ops

        self.repeats = repeats
        self.w, self.x = torch.randn(65536, 1024), torch.randn(1024)
        self.ops = cpu_ops()
        if self.ops is not None:
            self.wb = torch.randn(131072, 1024).bfloat16()
            self.xb = torch.randn(1, 1024).bfloat16()

    def __call__(self) -> float:
        gbs = self.w.nbytes / best(lambda: torch.mv(self.w, self.x), self.repeats) / 1e9
        if self.ops is not None:
            seconds = best(lambda: self.ops.linear_bf16(self.xb, self.wb, None), self.repeats)
            gbs = max(gbs, self.wb.nbytes / seconds / 1e9)
        return gbs


def gemm_ceiling(repeats: int) -> float:
    """GFLOP/s of torch's bf16 GEMM over one layer's SmolLM2 linears at 512 rows."""
    weights = [torch.randn(n, k).bfloat16() for n, k in SHAPES]
    xs = {k: torch.randn(512, k).bfloat16() for k in (576, 1536)}
    flops = sum(2 * 512 * w.numel() for w in weights)
    return flops / best(partial(_dense, torch.nn.functional.linear, xs, weights), repeats) / 1e9


def linears(ops, rows_levels: list[int], repeats: int, peak: float) -> list[dict]:
    from kvmesh.engine.kernels import has_amx
    from kvmesh.engine.layers.linear import AMX_ROWS
    from kvmesh.engine.quant.int4 import Int4Linear, Int4Weight

    bf16 = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    bf16.append([torch.randn(VOCAB, HIDDEN).bfloat16()])
    weights = [w for layer in bf16 for w in layer]
    int4 = [
        Int4Linear(Int4Weight.quantize(w.float(), 32, search=False), torch.bfloat16)
        for w in weights[:-1]
    ]
    dense_bytes = sum(w.nbytes for w in weights)
    int4_bytes = sum(q.nbytes for q in int4)
    out = []
    for rows in rows_levels:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        torch_s = best(partial(_dense, torch.nn.functional.linear, xs, weights), repeats)
        kernel_s = best(partial(_dense, ops.linear_bf16, xs, weights), repeats)
        row = {
            "rows": rows,
            "bf16_torch_gbs": dense_bytes / torch_s / 1e9,
            "bf16_kernel_gbs": dense_bytes / kernel_s / 1e9,
            "bf16_kernel_gflops": rows * dense_bytes / kernel_s / 1e9,
        }
        if has_amx() and rows <= AMX_ROWS:
            amx_s = best(partial(_dense, ops.linear_bf16_amx, xs, weights), repeats)
            row["bf16_amx_gbs"] = dense_bytes / amx_s / 1e9
        if rows <= 4:
            t4 = best(partial(_int4, _torch_int4, xs, int4), repeats)
            row["int4_torch_gbs"] = int4_bytes / t4 / 1e9
        if rows <= 4 and int4[0].has_small_batch_kernel:
            k4 = best(partial(_int4, partial(_kernel_int4, ops), xs, int4), repeats)
            row["int4_kernel_gbs"] = int4_bytes / k4 / 1e9
        row |= {
            k.replace("_gbs", "_of_ceiling"): v / peak for k, v in row.items() if k.endswith("_gbs")
        }
        out.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        print(out[-1], flush=True)
    return out


def _dense(matmul, xs, weights) -> None:
    for w in weights:
        matmul(xs[w.shape[1]], w, None)


def _int4(matmul, xs, layers) -> None:
    for q in layers:
        matmul(xs[q.in_features], q)


def _torch_int4(x, q):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q.packed, q.group, q.scales_zeros)


def _kernel_int4(ops, x, q):
    return ops.int4_linear(x, q.packed, q.group, q.scales_zeros, q.block)


def _attend(backend, q, kv, layers, meta) -> None:
    for layer in layers:
        backend.forward(q, kv, kv, layer, meta, 0.125)


def attention(streams: int, tokens: int, repeats: int, layers: int = 1) -> list[dict]:
    """ms per layer over `layers` layers' pools in turn (30, as in SmolLM2: the pages come from
    DRAM, as in a real step; 1: from cache where the pool fits)."""
    from kvmesh.engine.attention import BatchLayout, get_backend
    from kvmesh.engine.attention.base import Slots
    from kvmesh.engine.kv.layout import KVCacheSpec
    from kvmesh.engine.pool.kv_cache import PagedKVCache

    out, pages = [], streams * tokens // 16
    for kv_dtype in ("bf16", "fp8_e4m3"):
        spec = KVCacheSpec.gqa(layers, 3, 64, 16, kv_dtype)
        cache = PagedKVCache(spec, pages, torch.bfloat16)
        every = torch.arange(pages * 16)
        for layer in cache.layers:  # real values (random bytes would be denormals)
            kv = torch.randn(2, pages * 16, 3, 64).bfloat16()
            layer.write(Slots.of(every, 16), kv[0], kv[1])
        order = list(range(pages))
        random.Random(0).shuffle(order)
        per = tokens // 16
        tables = tuple(tuple(order[i * per : (i + 1) * per]) for i in range(streams))
        layout = BatchLayout(
            streams, tables, (tokens - 1,) * streams, (1,) * streams, 16, cache.null_page
        )
        q = torch.randn(streams, 9, 64).bfloat16()
        k = torch.randn(streams, 3, 64).bfloat16()
        ms = {}
        for name in ("torch", "cpu"):
            backend = get_backend(name, "gqa")
            meta = backend.build_metadata(layout)
            step = partial(_attend, backend, q, k, cache.layers, meta)
            ms[name] = 1e3 * best(step, repeats) / layers
        out.append(
            {
                "kv_dtype": kv_dtype,
                "streams": streams,
                "tokens": tokens,
                "layers": layers,
                "torch_ms_per_layer": round(ms["torch"], 3),
                "kernel_ms_per_layer": round(ms["cpu"], 3),
                "speedup": round(ms["torch"] / ms["cpu"], 2),
            }
        )
        print(out[-1], flush=True)
        del cache
    return out


def norm(ops, repeats: int) -> dict:
    from kvmesh.engine.layers.norm import rms_norm

    x, w = torch.randn(1, HIDDEN).bfloat16(), torch.rand(HIDDEN).bfloat16()
    f32 = lambda: torch.nn.functional.rms_norm(x.float(), (HIDDEN,), None, 1e-5)  # noqa: E731
    reference = lambda: w * f32().bfloat16()  # noqa: E731  (what layers/norm.py did before)
    loops = 200
    t = best(lambda: [reference() for _ in range(loops)], repeats) / loops
    k = best(lambda: [rms_norm(x, w, 1e-5) for _ in range(loops)], repeats) / loops
    return {
        "torch_us": round(t * 1e6, 2),
        "kernel_us": round(k * 1e6, 2),
        "speedup": round(t / k, 2),
    }


def run_kernels_bench(args: argparse.Namespace) -> int:
    from kvmesh.engine.kernels import build, cpu_ops

    ops = cpu_ops()
    if ops is None:
        raise InvalidRequestError(f"the CPU kernels do not run here: {build.missing_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    run = BenchRun()
    peak = ceiling(args.repeats)
    gemm = gemm_ceiling(args.repeats)
    print(
        f"memory-read ceiling (fastest GEMV over 256 MiB): {peak:.1f} GB/s; bf16 GEMM ceiling "
        f"(torch, 512 rows): {gemm:.0f} GFLOP/s",
        flush=True,
    )
    report = {
        **run.header(),
        "ceiling_gbs": round(peak, 2),
        "gemm_ceiling_gflops": round(gemm, 1),
        "linears": linears(ops, [int(r) for r in args.rows.split(",")], args.repeats, peak),
        "attention": attention(args.streams, args.tokens, args.repeats, args.layers),
        "rms_norm": norm(ops, args.repeats),
        **run.footer(),
    }
    print(report["rms_norm"])
    write_report(report, args.output)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="batch rows of the linears")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="context per stream")
    parser.add_argument(
        "--layers",
        type=int,
        default=30,
        help="attention: layers' pools visited in turn (1: one pool, cache-warm)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--output", default=None, help="also write the JSON report here")
