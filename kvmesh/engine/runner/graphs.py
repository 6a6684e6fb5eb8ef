"""Decode steps replayed from CUDA graphs (`--decode-step graphs`, the CUDA platform's default):
one graph per bucket of decode rows, captured at start-up, largest first, in one memory pool.

The shape discipline is compiled.py's: a step of B rows runs the graph of the smallest bucket
>= B, padding rows read the null page and write into the scratch page, block tables padded to
the longest context's pages. A graph reads its inputs from persistent buffers: a replay copies
the step's token ids, positions and attention metadata (slots, block tables, lengths: the
Triton backends' `TritonMetadata.copy_from`) into them, replays, and the outputs are the
graph's own tensors. Only attention backends whose metadata has fixed shapes per bucket and
whose kernels never wait for the host (`graphable`) can be captured: the Triton ones.

`record` is the one CUDA-only piece (torch.cuda.CUDAGraph); the tests record with `eager_record`
(replay = run the captured function again on the same buffers) on CPU under TRITON_INTERPRET=1,
which checks everything else: buckets, buffers, metadata copies, padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kvmesh.engine.runner.compiled import Bucketed, buckets_for

log = structlog.get_logger(__name__)
Recorder = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]


def cuda_record(pool: Any) -> Recorder:
    """Capture into a CUDAGraph sharing `pool` (torch.cuda.graph_pool_handle())."""

    def record(run: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph.replay, out

    return record


def eager_record(run: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """A graph's contract without CUDA: the outputs are the first run's tensors, and a replay
    runs again on the same buffers and writes into them."""
    out = run()

    def replay() -> None:
        with torch.inference_mode():  # (the outputs are inference tensors)
            for kept, new in zip(_tensors(out), _tensors(run()), strict=True):
                kept.copy_(new)

    return replay, out


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]


@dataclass
class _Graph:
    replay: Callable[[], None]
    ids: torch.Tensor
    positions: torch.Tensor
    meta: Any
    out: Any


class GraphDecode(Bucketed):
    """Graphs of one model's decode step, one per bucket (the runner's `compiled` role)."""

    def __init__(self, model, max_rows: int, max_pages: int, record: Recorder) -> None:
        self.model, self.record = model, record
        self.buckets = buckets_for(max_rows)
        self.max_pages = max_pages  # decode block tables are padded to this width
        self.ready: set[int] = set()
        self.failed: str | None = None
        self.replays = 0
        self._graphs: dict[int, _Graph] = {}

    def try_forward(self, input_ids, positions, meta, kv_caches, attention, capture):
        """The graph's outputs for this step (None: no graph for it; the caller runs eager)."""
        graph = self._graphs.get(len(input_ids))
        if graph is None or capture:
            return None
        graph.ids.copy_(input_ids, non_blocking=True)
        graph.positions.copy_(positions, non_blocking=True)
        graph.meta.copy_from(meta)
        graph.replay()
        self.replays += 1
        return graph.out

    def start(self, run_bucket) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its pool's memory), now:
        `run_bucket(bucket, forward)` runs one step of padding rows through `forward`."""
        for bucket in reversed(self.buckets):
            try:
                run_bucket(bucket, self._capture)
            except Exception as exc:  # a kernel that cannot be captured: stay eager
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                log.warning("graphs.failed", bucket=bucket, reason=self.failed)
                return
            self.ready.add(bucket)
        log.info("graphs.ready", buckets=sorted(self.ready))

    def _capture(self, input_ids, positions, meta, kv_caches, attention, capture) -> None:
        device = kv_caches[0].layer.data.device
        ids, positions = input_ids.to(device).clone(), positions.to(device).clone()
        meta = meta.static_copy(device)

        def run():
            with torch.no_grad():
                return self.model.forward(ids, positions, meta, kv_caches, attention, ())

        run()  # the kernels compiled and tuned before the capture
        replay, out = self.record(run)
        self._graphs[len(ids)] = _Graph(replay, ids, positions, meta, out)


def graph_decode(model, attention, page_size: int, max_rows: int, max_model_len: int, record):
    """A GraphDecode (the runner captures it) if the attention backend can be captured."""
    if not getattr(attention, "graphable", False):
        log.info("graphs.skipped", reason="the attention backend is not the Triton one")
        return None
    return GraphDecode(model, max_rows, -(-max_model_len // page_size), record)
