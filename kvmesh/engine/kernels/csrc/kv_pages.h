// The KV layers registered with kv_write.cpp, for the ops that write and read their pages.
#pragma once
#include <torch/extension.h>

namespace kvmesh::kv {

struct Pages {
  torch::Tensor data;                  // [P, heads, page_size, parts, dim]
  c10::optional<torch::Tensor> exps;  // [P, heads, page_size, parts] int8 for FP8
};

// The layer registered under `key` (throws if none).
Pages pages_of(int64_t key);

// One bf16 row of `dim` values into slot (page, slot)'s part of `head`: what paged_write_decode
// stores for it (as is, rounded, or FP8 with its exponent). Pages must be fp32, bf16 or fp8.
void store_bf16_row(const c10::BFloat16* x, int64_t dim, const Pages& p, int64_t page,
                    int64_t head, int64_t slot, int64_t part);

}  // namespace kvmesh::kv
