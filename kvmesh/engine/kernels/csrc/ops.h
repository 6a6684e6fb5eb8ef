// Torch-level entry points shared between the op files.
#pragma once
#include <torch/extension.h>

namespace kvmesh {

// q [B, H, k_dim] over pages data [P, Hkv, S, parts, D] (exps for FP8) -> [B, H, v_dim].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor data, c10::optional<torch::Tensor> exps,
                           torch::Tensor block_tables, torch::Tensor lengths, int64_t k_part,
                           int64_t v_part, int64_t v_dim, double scale);

}  // namespace kvmesh
