"""The fused decode step: a decode step of a dense GQA decoder (the Llama family) as one C++ op
(kernels/csrc/decoder.cpp) instead of ~20 Python-dispatched ops per layer.

- The op runs the same op bodies in the same order as `DecoderModel.forward`, so its outputs
  are the eager step's bit for bit (tests/integration/test_fused_decode.py); what it removes is the
  per-op Python and dispatcher time, a large share of a one-stream step (docs/benchmarks.md,
  "Compiled and fused decode steps vs eager"; docs/benchmarks-history.md, "The fused decode
  step, and the mesh on the Zen 3 EPYC").
- The weights are registered once; a step passes its ids, RoPE rows, slots, block tables and,
  per linear role, the kernel the eager linear would run at its row count (`kernel_of`).
- Which models: `DecoderModel`s whose every layer is `GqaAttention` without q/k norms and with
  full-width RoPE, a `GatedMLP` without biases, dense weights in the compute dtype or INT4
  ones (CPU layout), a dense embedding, over the CPU kernels' paged attention. Others, and
  steps with prefill chunks, run eager. `decode_step="eager"` turns it off.
- Draft verification: the runner hands a chunk verifying k drafts over as k + 1 decode rows
  (runner.py `_verify_rows_as_decode_rows`).
"""

from __future__ import annotations

import itertools
import weakref

import structlog
import torch

from kvmesh.engine.attention.paged import PagedAttention, PagedMetadata
from kvmesh.engine.kernels import cpu_ops
from kvmesh.engine.layers.gqa import GqaAttention
from kvmesh.engine.layers.linear import BiasedInt4Linear, DenseLinear, dense_kernel
from kvmesh.engine.layers.mlp import GatedMLP
from kvmesh.engine.platform import kernels_for
from kvmesh.engine.quant.int4 import SMALL_BATCH, Int4Linear
from kvmesh.engine.runner import weight_arena

log = structlog.get_logger(__name__)
_KEYS = itertools.count()
INT4_SMALL, INT4_TORCH = (
    3,
    4,
)  # beside dense_kernel's GEMV, AMX, TORCH, WEIGHT_LEFT (decoder.cpp Kernel)


def kernel_of(linear, rows: int) -> int:
    """The kernel `linear` runs at `rows` rows of its compute dtype on CPU."""
    if isinstance(linear, DenseLinear):
        w = linear.weight
        return dense_kernel(rows, w)
    return INT4_SMALL if _int4(linear).runs_small_batch(rows) else INT4_TORCH


def _int4(linear) -> Int4Linear:
    """The INT4 product of an INT4 linear, biased or not."""
    return linear.inner if isinstance(linear, BiasedInt4Linear) else linear


def _parts(linear) -> tuple[list[torch.Tensor], list[int]]:
    """([weight or INT4 packed, bias, INT4 scales|zeros], [INT4 group, row block] or [0, 0]):
    what register_decoder takes per linear, absent tensors empty."""
    if isinstance(linear, DenseLinear):
        return [linear.weight, _or_empty(linear.bias), torch.empty(0)], [0, 0]
    bias = linear.bias if isinstance(linear, BiasedInt4Linear) else None
    int4 = _int4(linear)
    return [int4.packed, _or_empty(bias), int4.scales_zeros], [int4.group, int4.block]


class FusedDecode:
    """One registered decoder; `forward` runs a step of decode rows through it."""

    def __init__(self, model, kv_caches: list) -> None:
        ops = cpu_ops()
        self.model = model
        self.key = next(_KEYS)
        self.roles = _roles(model.layers[0])  # every layer's kernels are alike (unfit_reason)
        # the weights in the order the step streams them, in one allocation (weight_arena.py)
        self.arena = weight_arena.pack([x for layer in model.layers for x in _roles(layer)])
        tensors, int4 = [], []
        for layer in model.layers:
            tensors += [layer.input_norm, layer.post_norm]
            for linear in _roles(layer):
                parts, group_and_block = _parts(linear)
                tensors += parts
                int4 += group_and_block
        c = model.config
        ops.register_decoder(
            self.key,
            model.embed,
            tensors,
            int4,
            [int(kv.layer.key) for kv in kv_caches],
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.rms_norm_eps,
            model.layers[0].attention.scale,
        )
        weakref.finalize(self, ops.forget_decoder, self.key)

    def kernels(self, rows: int) -> list[int]:
        """The linear kernel of each role (qkv, o, gate|up, down) at `rows` rows."""
        return [kernel_of(linear, rows) for linear in self.roles]

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: PagedMetadata, capture=()):
        """`DecoderModel.forward` of a step whose rows are all decode rows (one token each)."""
        cos, sin = self.model.rope.tables(positions)
        slots, kernels = meta.slot_mapping, self.kernels(input_ids.shape[0])
        out = cpu_ops().decoder_forward(
            self.key,
            input_ids,
            cos,
            sin,
            slots.page,
            slots.offset,
            meta.block_tables,
            meta.lengths,
            kernels,
            list(capture),
        )
        return out[0], torch.cat(out[1:], dim=-1) if len(out) > 1 else None


def _roles(layer) -> tuple:
    a, m = layer.attention, layer.mlp
    return a.qkv, a.o_proj, m.gate_up, m.down


def _or_empty(bias: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0) if bias is None else bias


def _fits(linear, dtype: torch.dtype) -> bool:
    if isinstance(linear, DenseLinear):
        return linear.weight.dtype == dtype
    int4 = _int4(linear)
    return isinstance(int4, Int4Linear)


def unfit_reason(model, attention) -> str | None:
    """Why `model` cannot run fused over `attention`; None when it can."""
    from kvmesh.engine.models.base import DecoderModel, LocalEnds

    if cpu_ops() is None:
        return "no CPU kernels"
    if not isinstance(model, DecoderModel) or type(model).forward is not DecoderModel.forward:
        return "not a plain decoder"
    if type(model.ends) is not LocalEnds:
        return "ends joined to other ranks or stages"
    if not isinstance(model.embed, torch.Tensor):
        return "INT4 embeddings"
    if kernels_for(model.embed) is None:
        return "weights where the CPU kernels do not run"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return "a compute dtype without kernels"
    kinds = None  # every layer's linears must take the first layer's kernels at any row count
    for layer in model.layers:
        a, m = layer.attention, layer.mlp
        if type(a) is not GqaAttention or a.q_norm is not None or a.rotary_dim != a.config.head_dim:
            return "attention other than GQA with full-width RoPE and no q/k norms"
        if type(m) is not GatedMLP:
            return "an MLP other than the dense gated one"
        if not all(_fits(x, model.dtype) for x in _roles(layer)):
            return "weights neither dense in the compute dtype nor CPU INT4"
        if any(getattr(x, "bias", None) is not None for x in (m.gate_up, m.down)):
            return "MLP biases"
        these = [(kernel_of(x, 1), kernel_of(x, SMALL_BATCH + 1)) for x in _roles(layer)]
        kinds = kinds or these
        if these != kinds:
            return "layers whose linears take different kernels"
    if type(attention) is not PagedAttention:
        return "the attention backend is not the CPU kernels' paged attention"
    return None


def fused_decode(model, kv_layers, attention) -> FusedDecode | None:
    """A FusedDecode of `model` if it fits (else None, the reason logged)."""
    reason = unfit_reason(model, attention)
    if reason is not None:
        log.info("fused_decode.skipped", reason=reason)
        return None
    return FusedDecode(model, kv_layers)
