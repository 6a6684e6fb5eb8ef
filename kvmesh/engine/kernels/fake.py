"""Output shapes of the kernels' ops for torch.compile tracing (no data is read): the same
shapes, dtypes and layouts as the C++ in csrc/ops.cpp returns."""

from __future__ import annotations

import torch


@torch.library.register_fake("kvmesh::paged_decode")
def _paged_decode(q, data, exps, block_tables, lengths, k_part, v_part, v_dim, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


@torch.library.register_fake("kvmesh::linear_bf16")
def _linear_bf16(x, w, bias):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("kvmesh::linear_f32")
def _linear_f32(x, w, bias):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("kvmesh::linear_bf16_amx")
def _linear_bf16_amx(x, w, bias):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("kvmesh::int4_linear")
def _int4_linear(x, packed, group, scales_zeros, block):
    return x.new_empty(x.shape[0], scales_zeros.shape[1])


@torch.library.register_fake("kvmesh::rms_norm")
def _rms_norm(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("kvmesh::add_rms_norm")
def _add_rms_norm(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("kvmesh::argmax_rows")
def _argmax_rows(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


@torch.library.register_fake("kvmesh::rope")
def _rope(x, cos, sin):
    return x.new_empty(x.shape)


@torch.library.register_fake("kvmesh::paged_write_decode")
def _paged_write_decode(q, fresh, key, page, offset, block_tables, lengths, v_part, v_dim, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


@torch.library.register_fake("kvmesh::silu_mul")
def _silu_mul(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
