"""The runner's decode-step strategy, by `--decode-step`: decode (and verify) steps as one C++
op (fused_decode.py), or decode-only steps through per-bucket graphs -- inductor's on CPU
(compiled.py), CUDA's on a GPU (graphs.py) -- each where the model and backend fit it (else
eager, logged)."""

from __future__ import annotations

from typing import Any

from kvmesh.engine.runner.compiled import compiled_decode
from kvmesh.engine.runner.fused_decode import fused_decode
from kvmesh.engine.runner.graphs import graph_decode


def decode_steps(options: Any, model, kv, attention) -> tuple[Any, Any]:
    """(the fused step or None, the bucketed graphs or None, not started: the runner starts
    them, compiled in the background, CUDA's captured at once) for RunnerOptions `options`."""
    size = kv.spec.page_size
    if options.decode_step == "fused":
        return fused_decode(model, kv.layers, attention), None
    if options.decode_step == "compiled":
        graphs = compiled_decode(model, attention, size, options.max_rows, options.max_model_len)
    elif options.decode_step == "graphs":
        graphs = graph_decode(
            model, attention, size, options.max_rows, options.max_model_len, options.record
        )
    else:
        return None, None
    return None, graphs
