"""The compiled decode step: torch.compile (inductor, CPU) of the model's forward for steps whose
rows are all single-token decode rows -- the CPU counterpart of CUDA graphs.

- Static shapes, bucketed: a step of B rows runs the graph of the smallest bucket >= B. Padding
  rows read the null page and write their K/V into the pool's scratch page (never allocated);
  block tables are padded to the longest context's pages, so a graph never depends on lengths.
- What a graph holds: the kernels' ops (kernels/csrc: GEMV, RMSNorm with the residual add,
  RoPE, the write-and-attend op) and inductor's fused C++ for everything between them (the
  gate's SiLU times up, residual adds, slicing), with eager's bf16 roundings kept
  (`emulate_precision_casts`), so greedy tokens are those of the eager step (tests).
- Compiled graphs are cached on disk ($KVMESH_HOME/inductor): a restart loads them.
- Buckets compile in a background thread, smallest first; until a bucket is ready its steps run
  eager. A model that does not compile whole (MoE's data-dependent expert groups) or a failed
  compile leaves every step eager, logged once.
- Opt-in (`decode_step="compiled"`, `--decode-step compiled`): the compiled step gains little
  over the eager one and loses at some batches (docs/benchmarks.md, "Compiled and fused decode
  steps vs eager"), because the kernels already cover the heavy ops and a graph's guards and
  wrapper cost about what the eager glue did.
"""

from __future__ import annotations

import os
import threading
import time

import structlog
import torch

from kvmesh import env

log = structlog.get_logger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def buckets_for(max_rows: int) -> tuple[int, ...]:
    return tuple(b for b in BUCKETS if b < max_rows) + (max_rows,)


class Bucketed:
    """Graphs per bucket of decode rows (this module's, runner/graphs.py's): which one a step
    of some rows runs, once it is ready."""

    buckets: tuple[int, ...]
    ready: set[int]
    failed: str | None

    def bucket(self, rows: int) -> int | None:
        """The bucket of a decode-only step of `rows` rows, if its graph is ready."""
        if self.failed is not None:
            return None
        bucket = next((b for b in self.buckets if b >= rows), None)
        return bucket if bucket in self.ready else None


def configure_inductor() -> None:
    """Inductor's on-disk caches under KVMESH_HOME, compiles in this process (no worker pool
    that could outlive it), eager's bf16 roundings."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(env.kvmesh_home() / "inductor"))
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    inductor_config.emulate_precision_casts = True
    inductor_config.fx_graph_cache = True
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 2 * len(BUCKETS))


class CompiledDecode(Bucketed):
    """Compiled forwards of one model, one graph per bucket of decode rows."""

    def __init__(self, model, max_rows: int, max_pages: int) -> None:
        configure_inductor()
        self.model = model
        self.buckets = buckets_for(max_rows)
        self.max_pages = max_pages  # decode block tables are padded to this width
        self.ready: set[int] = set()
        self.seconds: dict[int, float] = {}  # bucket -> seconds its warm-up compile took
        self.failed: str | None = None
        raw = type(model).forward.__wrapped__  # the forward without its inference_mode
        self._compiled = torch.compile(raw, fullgraph=True, dynamic=False)
        self._lock = threading.Lock()  # one graph runs or compiles at a time

    def try_forward(self, input_ids, positions, meta, kv_caches, attention, capture):
        """The compiled forward, or None while the warm-up thread is compiling (dynamo's caches
        are not for two threads at once): the caller runs the step eager instead of waiting."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._run(input_ids, positions, meta, kv_caches, attention, capture)
        finally:
            self._lock.release()

    def _run(self, input_ids, positions, meta, kv_caches, attention, capture):
        with torch.no_grad():
            return self._compiled(
                self.model, input_ids, positions, meta, kv_caches, attention, capture
            )

    def warm_up(self, run_bucket) -> None:
        """Compile every bucket, smallest first: `run_bucket(bucket, forward)` runs one step of
        only padding rows through `forward` (which compiles that bucket's graph)."""
        for bucket in self.buckets:
            started = time.perf_counter()
            try:
                with self._lock:
                    run_bucket(bucket, self._run)
            except Exception as exc:  # a graph break or a compiler error: stay eager
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                log.warning("compile.failed", bucket=bucket, reason=self.failed)
                return
            self.seconds[bucket] = round(time.perf_counter() - started, 2)
            self.ready.add(bucket)
            log.info("compile.ready", bucket=bucket, seconds=self.seconds[bucket])

    def start(self, run_bucket) -> threading.Thread:
        thread = threading.Thread(
            target=self.warm_up, args=(run_bucket,), name="kvmesh-compile", daemon=True
        )
        thread.start()
        return thread


def compiled_decode(
    model, attention, page_size: int, max_rows: int, max_model_len: int
) -> CompiledDecode | None:
    """A CompiledDecode (not started: the runner starts it) if the attention backend is one a
    graph can hold (the CPU kernels' backends)."""
    if not attention.compilable:
        log.info("compile.skipped", reason="the attention backend is not the CPU kernels'")
        return None
    return CompiledDecode(model, max_rows, -(-max_model_len // page_size))
