"""The GPU path's one device check: what only a GPU can run, in under 5 minutes on one GPU, from
a bare checkout with PYTHONPATH (no pip install of kvmesh). Writes device_check.json.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl  # structlog
    PYTHONPATH=/tmp/site:. python3 scripts/device_check.py --out $OUT

Wheels to carry on the lent machines (their image has torch, triton, transformers, tokenizers,
safetensors, xxhash, grpcio, protobuf, numpy): structlog. Sections, each reported on its own
(an error in one does not stop the others):
- kernels: the Triton kernel checks of tests/unit (FP8 codec, paged attention with the fused KV
  write, W4A16, grouped MoE) on CUDA tensors against the torch references on the CPU;
- engine: tiny random Llama and DeepSeek-V3 checkpoints on `--device cuda`: eager steps vs CUDA
  graph replays token-equal (replays under torch.cuda.set_sync_debug_mode("error")), FP8 pages,
  the CPU engine's fp32 tokens for comparison, two tensor-parallel ranks on the one GPU (their
  own GPU pools, staged through the shared host block; gloo, as NCCL wants a GPU per rank), and
  the FlashInfer backends' bf16 tokens where flashinfer-python is installed;
- attention: decode attention timings (batch 1/8/64, contexts 1k/4k; GQA 32/8 x 128 bf16 and
  FP8, MLA 128 heads x 512+64) with the KV bytes read per second;
- probe: the card's bf16 GEMM rate, device copy bandwidth, W4A16 vs bf16 GEMV, and the staged
  transfer mode's pinned host <-> device page copies.
`--dry-run` runs the attention and probe sections tiny on the CPU under TRITON_INTERPRET=1 (what
tests/unit/test_device_check.py does): a check of the script, not of a GPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_CHECKS = ("test_kv_fp8_triton.py", "test_triton_attention.py", "test_triton_linears.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for device_check.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny, on the CPU (interpreter)")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    device = torch.device("cpu" if args.dry_run else "cuda")
    report: dict = {"env": _env(torch, device)}
    sections = [("attention", attention_timings), ("probe", probe)]
    if not args.dry_run:
        sections = [("kernels", kernel_checks), ("engine", engine_checks), *sections]
    for name, run in sections:
        started = time.perf_counter()
        try:
            report[name] = run(device, args.dry_run)
        except Exception:
            report[name] = {"error": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {json.dumps(report[name])[:400]}", flush=True)
    out = Path(args.out) / "device_check.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0 if all("error" not in v for k, v in report.items() if k != "env") else 1


def _env(torch, device) -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"card": props.name, "sms": props.multi_processor_count, "capability": props.major}
    return env


def kernel_checks(device, dry_run: bool) -> dict:
    """Each tests/unit Triton check's script on CUDA tensors (no pytest needed)."""
    results = {}
    for name in KERNEL_CHECKS:
        script = _check_script(ROOT / "tests" / "unit" / name).format(device=device.type)
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": _pythonpath()}
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240
        )
        ok = run.returncode == 0 and run.stdout.rstrip().endswith("ok")
        results[name] = "ok" if ok else (run.stderr or run.stdout)[-1500:]
    if any(v != "ok" for v in results.values()):
        results["error"] = "a kernel check failed"
    return results


def _check_script(path: Path) -> str:
    """The module-level CHECK string of a test file, read without importing it (pytest)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CHECK":
            return textwrap.dedent(ast.literal_eval(node.value.args[0]))
    raise ValueError(f"no CHECK in {path}")


def _pythonpath() -> str:
    return os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])


def engine_checks(device, dry_run: bool) -> dict:
    """Greedy tokens of tiny models on the GPU: eager vs graphs (sync-free replays), FP8 pages,
    against the CPU engine in fp32."""
    import torch

    from kvmesh import LLM, SamplingParams
    from kvmesh.engine.runner import graphs
    from kvmesh_apps.tools.tiny_configs import TinySpec
    from kvmesh_apps.tools.tiny_models import make_tiny_model

    _strict_replays(graphs, torch)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (37, 45, 30, 70)]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "deepseek_v3"):
            path = str(make_tiny_model(TinySpec(arch), Path(tmp) / arch).path)
            cpu = LLM(path, dtype="fp32", num_pages=64).generate_ids(prompts, greedy)
            runs = {"cpu_fp32": [o.token_ids for o in cpu]}
            for label, options in (
                ("cuda_fp32_eager", {"dtype": "fp32", "decode_step": "eager"}),
                ("cuda_fp32_graphs", {"dtype": "fp32"}),
                ("cuda_bf16_graphs", {"dtype": "bf16"}),
                ("cuda_fp8_pages_graphs", {"dtype": "bf16", "kv_dtype": "fp8_e4m3"}),
            ):
                llm = LLM(path, device="cuda", num_pages=64, max_num_seqs=8, **options)
                runs[label] = [o.token_ids for o in llm.generate_ids(prompts, greedy)]
                step = llm.engine.runner.compiled
                runs[label + "_replays"] = getattr(step, "replays", 0)
                del llm
            runs |= _flashinfer_run(path, prompts, greedy)
            two = LLM(path, device="cuda", dtype="fp32", num_pages=64, tensor_parallel_size=2)
            with two:  # both ranks on this GPU (gloo: NCCL needs a GPU each), pools staged
                runs["cuda_fp32_tp2_staged"] = [
                    o.token_ids for o in two.generate_ids(prompts, greedy)
                ]
            results[arch] = {
                "graphs_equal_eager": runs["cuda_fp32_graphs"] == runs["cuda_fp32_eager"],
                "cuda_fp32_equal_cpu_fp32": runs["cuda_fp32_eager"] == runs["cpu_fp32"],
                "tp2_equal_one_rank": runs["cuda_fp32_tp2_staged"] == runs["cuda_fp32_eager"],
                "replays": runs["cuda_fp32_graphs_replays"],
                "tokens": runs,
            }
    if not all(r["graphs_equal_eager"] and r["replays"] for r in results.values()):
        results["error"] = "graph replays differ from eager steps, or none ran"
    return results


def _flashinfer_run(path: str, prompts, greedy) -> dict:
    """bf16 tokens with `--attention-backend flashinfer` (GQA or MLA wrapper), where
    flashinfer-python is installed; a failure is reported, not raised (an optional backend)."""
    from kvmesh import LLM

    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return {"cuda_bf16_flashinfer": "flashinfer-python not installed"}
    try:
        llm = LLM(path, device="cuda", dtype="bf16", num_pages=64, attention_backend="flashinfer")
        return {"cuda_bf16_flashinfer": [o.token_ids for o in llm.generate_ids(prompts, greedy)]}
    except Exception:
        return {"cuda_bf16_flashinfer": traceback.format_exc()[-1500:]}


def _strict_replays(graphs, torch) -> None:
    """Every graph replay under set_sync_debug_mode("error"): one that waits for the host
    raises instead of passing."""
    capture = graphs.GraphDecode._capture

    def strict(self, *args):
        capture(self, *args)
        bucket = len(args[0])
        replay = self._graphs[bucket].replay

        def checked():
            torch.cuda.set_sync_debug_mode("error")
            try:
                replay()
            finally:
                torch.cuda.set_sync_debug_mode("default")

        self._graphs[bucket].replay = checked

    graphs.GraphDecode._capture = strict


def attention_timings(device, dry_run: bool) -> dict:
    """Decode attention over random pages: microseconds per launch and KV bytes read per
    second, per (kind, pages, batch, context)."""
    from kvmesh.engine.kv.layout import LayerKVSpec

    shapes = {  # kind: (q heads, layer spec, dims, v part)
        "gqa": (32, LayerKVSpec("gqa", 8, 128), (128, 0), 1),
        "mla": (128, LayerKVSpec("mla", 1, 576), (512, 64), 0),
    }
    if dry_run:
        shapes = {
            "gqa": (4, LayerKVSpec("gqa", 1, 32), (32, 0), 1),
            "mla": (4, LayerKVSpec("mla", 1, 48), (32, 16), 0),
        }
    grid = [(1, 256), (2, 64)] if dry_run else [(b, c) for b in (1, 8, 64) for c in (1024, 4096)]
    out: dict = {}
    for kind, shape in shapes.items():
        for kv_dtype in ("bf16",) if dry_run else ("bf16", "fp8_e4m3"):
            for batch, context in grid:
                case = _attention_case(device, shape, kv_dtype, batch, context)
                seconds, kv_bytes = case(2 if dry_run else 20)
                out[f"{kind}/{kv_dtype}/b{batch}/ctx{context}"] = {
                    "us": round(seconds * 1e6, 1),
                    "kv_gb_s": round(kv_bytes / seconds / 1e9, 1),
                }
    return out


def _attention_case(device, shape, kv_dtype: str, batch: int, context: int):
    """A timer of one decode launch: `batch` rows of `context` tokens in their own pages."""
    import torch

    from kvmesh.engine.attention import BatchLayout
    from kvmesh.engine.attention.triton_paged import build_triton_metadata
    from kvmesh.engine.kernels.gpu.attention import paged_attention
    from kvmesh.engine.kv.layout import KVCacheSpec
    from kvmesh.engine.pool.kv_cache import PagedKVCache

    heads, layer, dims, v_part = shape
    per_row = context // 16
    pages = batch * per_row
    spec = KVCacheSpec((layer,), 16, kv_dtype)
    cache = PagedKVCache(spec, pages, torch.bfloat16, pool=_pool(spec, pages, device))
    kv = cache.layers[0].layer
    if kv_dtype == "bf16":
        kv.data.normal_()
    tables = tuple(tuple(range(i * per_row, (i + 1) * per_row)) for i in range(batch))
    layout = BatchLayout(batch, tables, (context - 1,) * batch, (1,) * batch, 16, pages)
    plan = build_triton_metadata(layout).on(device).plans[0]
    q = torch.randn(batch, heads, sum(dims), device=device, dtype=torch.bfloat16)
    o = torch.empty(batch, heads, dims[0], device=device, dtype=torch.bfloat16)

    def timed(iterations: int) -> tuple[float, int]:
        def launch():
            paged_attention(q, kv.data, kv.exps, plan, v_part, dims, 0.1, o)

        return _time(launch, device, iterations), batch * context * spec.bytes_per_token()

    return timed


def _pool(spec, pages, device):
    import torch

    return torch.zeros(pages + 2, spec.page_bytes, dtype=torch.uint8, device=device)


def _time(fn, device, iterations: int) -> float:
    """Seconds per call (CUDA events on a GPU), after one warm-up call."""
    import torch

    fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iterations):
            fn()
        return (time.perf_counter() - started) / iterations
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iterations


def probe(device, dry_run: bool) -> dict:
    """The card: bf16 GEMM rate, device copy bandwidth, W4A16 GEMV vs bf16, staged page
    copies between pinned host memory and the device."""
    import torch

    from kvmesh.engine.quant.int4 import Int4Weight
    from kvmesh.engine.quant.int4_cuda import CudaInt4Linear

    n = 64 if dry_run else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    gemm = _time(lambda: a @ a, device, 2 if dry_run else 10)
    big = torch.empty((1 << 20) if dry_run else (1 << 30), dtype=torch.uint8, device=device)
    copy = _time(lambda: big.clone(), device, 2 if dry_run else 10)
    k = 256 if dry_run else 4096
    weight = Int4Weight.quantize(torch.randn(k, k), 128, search=False)
    int4 = CudaInt4Linear(weight, torch.bfloat16, device)
    dense = weight.dequantize().to(device, torch.bfloat16)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    pages = torch.empty(64, (1 << 12) if dry_run else (1 << 20), dtype=torch.uint8, device=device)
    host = torch.empty(pages.shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
    reps = 2 if dry_run else 10

    def d2h():
        host.copy_(pages, non_blocking=True)

    def h2d():
        pages.copy_(host, non_blocking=True)

    return {
        "bf16_gemm_tflops": round(2 * n**3 / gemm / 1e12, 1),
        "device_copy_gb_s": round(2 * big.numel() / copy / 1e9, 1),
        "w4a16_gemv_us": round(_time(lambda: int4(x), device, reps) * 1e6, 1),
        "bf16_gemv_us": round(_time(lambda: x @ dense.t(), device, reps) * 1e6, 1),
        "staged_d2h_gb_s": round(
            host.numel() / _time(lambda: host.copy_(pages), device, reps) / 1e9, 1
        ),
        "staged_h2d_gb_s": round(
            host.numel() / _time(lambda: pages.copy_(host), device, reps) / 1e9, 1
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
