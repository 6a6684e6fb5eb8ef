// Torch-level entry points shared between the op files.
#pragma once
#include <torch/extension.h>

#include "kernels.h"

namespace kvmesh {

// The kernels' view of one layer's pages data [P, Hkv, S, parts, D] (exps for FP8).
PagedKV paged_kv(const torch::Tensor& data, const c10::optional<torch::Tensor>& exps,
                 int64_t k_part, int64_t v_part, int64_t k_dim, int64_t v_dim);

// paged_decode's work items over `threads` threads: (row, KV head, slice of its query heads).
struct DecodeItems {
  DecodeItems(int64_t batch, int64_t heads, int64_t kv_heads, int64_t threads);
  // item's heads of its row; `end`: where this thread's items end (it asks for the next's pages)
  void run(const PagedKV& kv, const DecodeRows& rows, int64_t item, int64_t end) const;
  int64_t kv_heads, group, slices = 1, per = 1, count = 0;
};

// q [B, H, k_dim] over pages data [P, Hkv, S, parts, D] (exps for FP8) -> [B, H, v_dim].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor data, c10::optional<torch::Tensor> exps,
                           torch::Tensor block_tables, torch::Tensor lengths, int64_t k_part,
                           int64_t v_part, int64_t v_dim, double scale);

}  // namespace kvmesh

// The ops' bodies (ops.cpp, kv_write.cpp), callable from C++ without the dispatcher: the fused
// decoder (decoder.cpp) runs these, so its bits are those of the eager step's op calls.
namespace kvmesh::ops {

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_bf16_amx(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, int64_t group,
                          torch::Tensor scales_zeros, int64_t block);
torch::Tensor rms_norm_only(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
// new rows written into the pages of the KV layer registered under `key`, then q attended
torch::Tensor paged_write_decode(torch::Tensor q, torch::Tensor fresh, int64_t key,
                                 torch::Tensor page, torch::Tensor offset,
                                 torch::Tensor block_tables, torch::Tensor lengths,
                                 int64_t v_part, int64_t v_dim, double scale);

}  // namespace kvmesh::ops
