"""The fused decode step: a decode-only step of a dense GQA decoder (the Llama family) as one C++
op (kernels/csrc/decoder.cpp) instead of ~20 Python-dispatched ops per layer.

- The op runs the same op bodies in the same order as `DecoderModel.forward`, so its outputs
  are the eager step's bit for bit (tests/unit/test_fused_decode.py); what it removes is the
  per-op Python and dispatcher time, ~0.3-0.45 ms per layer on these 2-core machines
  (docs/benchmarks.md), which at one stream was a quarter of the step.
- The weights are registered once; a step passes its ids, RoPE rows, slots, block tables and,
  per linear role, the kernel `dense_kernel` picks for its row count (GEMV, AMX or torch).
- Which models: `DecoderModel`s whose every layer is `GqaAttention` without q/k norms and with
  full-width RoPE, a `GatedMLP` without biases, dense (not INT4) weights in the compute dtype,
  a dense embedding, over the CPU kernels' paged attention. Others, and steps with prefill or
  draft rows, run eager. `decode_step="eager"` turns it off.
"""

from __future__ import annotations

import itertools
import weakref

import structlog
import torch

from kvmesh.engine.attention.paged import PagedAttention, PagedMetadata
from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.layers.gqa import GqaAttention
from kvmesh.engine.layers.linear import TORCH, DenseLinear, dense_kernel
from kvmesh.engine.layers.mlp import GatedMLP

log = structlog.get_logger(__name__)
_KEYS = itertools.count()


class FusedDecode:
    """One registered decoder; `forward` runs a decode-only step through it."""

    def __init__(self, model, kv_caches: list) -> None:
        ops = cpu_ops()
        self.model = model
        self.key = next(_KEYS)
        layers = model.layers
        first = layers[0].attention
        self.roles = (first.qkv.weight, first.o_proj.weight, layers[0].mlp.gate_up.weight,
                      layers[0].mlp.down.weight)  # fmt: skip
        self.bf16 = model.dtype is torch.bfloat16
        tensors = []
        for layer in layers:
            a, m = layer.attention, layer.mlp
            tensors += [layer.input_norm, a.qkv.weight, _or_empty(a.qkv.bias), a.o_proj.weight,
                        _or_empty(a.o_proj.bias), layer.post_norm, m.gate_up.weight,
                        m.down.weight]  # fmt: skip
        c = model.config
        ops.register_decoder(self.key, model.embed, tensors,
                             [int(kv.layer.key) for kv in kv_caches], c.num_heads,
                             c.num_kv_heads, c.head_dim, c.rms_norm_eps, first.scale)  # fmt: skip
        weakref.finalize(self, ops.forget_decoder, self.key)

    def kernels(self, rows: int) -> list[int]:
        """The linear kernel of each role (qkv, o, gate|up, down) at `rows` rows."""
        if not self.bf16:
            return [TORCH] * 4
        return [dense_kernel(rows, w) for w in self.roles]

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: PagedMetadata, capture=()):
        """`DecoderModel.forward` of a step whose rows are all decode rows."""
        cos, sin = self.model.rope.tables(positions)
        slots = meta.slot_mapping
        out = cpu_ops().decoder_forward(self.key, input_ids, cos, sin, slots.page, slots.offset,
                                        meta.block_tables, meta.lengths,
                                        self.kernels(input_ids.shape[0]), list(capture))  # fmt: skip
        return out[0], torch.cat(out[1:], dim=-1) if len(out) > 1 else None


def _or_empty(bias: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0) if bias is None else bias


def unfit_reason(model, attention) -> str | None:
    """Why `model` cannot run fused over `attention`; None when it can."""
    from kvmesh.engine.models.base import DecoderModel

    if cpu_ops() is None:
        return "no CPU kernels"
    if not isinstance(model, DecoderModel) or type(model).forward is not DecoderModel.forward:
        return "not a plain decoder"
    if not isinstance(model.embed, torch.Tensor):
        return "INT4 embeddings"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return "a compute dtype without kernels"
    for layer in model.layers:
        a, m = layer.attention, layer.mlp
        if type(a) is not GqaAttention or a.q_norm is not None or a.rotary_dim != a.config.head_dim:
            return "attention other than GQA with full-width RoPE and no q/k norms"
        if type(m) is not GatedMLP:
            return "an MLP other than the dense gated one"
        linears = (a.qkv, a.o_proj, m.gate_up, m.down)
        if any(type(x) is not DenseLinear or x.weight.dtype != model.dtype for x in linears):
            return "weights not dense in the compute dtype (INT4)"
        if m.gate_up.bias is not None or m.down.bias is not None:
            return "MLP biases"
    if type(attention) is not PagedAttention:
        return "the attention backend is not the CPU kernels' paged attention"
    return None


def fuse_decode(runner, decode_step: str) -> FusedDecode | None:
    """With decode_step "fused": attach a FusedDecode to `runner` if its model fits."""
    if decode_step != "fused":
        return None
    reason = unfit_reason(runner.model, runner.attention)
    if reason is not None:
        log.info("fused_decode.skipped", reason=reason)
        return None
    runner.fused = FusedDecode(runner.model, runner.kv.layers)
    return runner.fused
