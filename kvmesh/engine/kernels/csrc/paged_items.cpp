// The kernels' view of one layer's KV pages, and how paged_decode splits its work over threads
// (ops.cpp and decoder_rows.cpp share both).
#include <torch/extension.h>

#include <algorithm>

#include "kernels.h"
#include "ops.h"
#include "simd.h"

namespace {

int storage_of(const torch::Tensor& data) {
  switch (data.scalar_type()) {
    case torch::kFloat: return kvmesh::kF32;
    case torch::kBFloat16: return kvmesh::kBF16;
    case torch::kChar: return kvmesh::kFP8;
    default: TORCH_CHECK(false, "KV pages must be fp32, bf16 or fp8 (int8) bytes, got ", data.scalar_type());
  }
}

}  // namespace

kvmesh::PagedKV kvmesh::paged_kv(const torch::Tensor& data, const c10::optional<torch::Tensor>& exps,
                                 int64_t k_part, int64_t v_part, int64_t k_dim, int64_t v_dim) {
  kvmesh::PagedKV kv{};
  kv.data = data.data_ptr();
  kv.storage = storage_of(data);
  kv.page_stride = data.stride(0), kv.head_stride = data.stride(1);
  kv.slot_stride = data.stride(2), kv.part_stride = data.stride(3);
  if (kv.storage == kvmesh::kFP8) {
    TORCH_CHECK(exps.has_value() && exps->scalar_type() == torch::kChar, "FP8 pages need exps");
    kv.exps = exps->data_ptr<int8_t>();
    kv.exp_page = exps->stride(0), kv.exp_head = exps->stride(1);
    kv.exp_slot = exps->stride(2), kv.exp_part = exps->stride(3);
  }
  kv.page_size = (int)data.size(2);
  kv.k_part = (int)k_part, kv.v_part = (int)v_part;
  kv.k_dim = (int)k_dim, kv.v_dim = (int)v_dim;
  return kv;
}

// Work items: (row, KV head, slice of its query heads). Slicing only splits the work; every
// head's result is the same whatever the split.
kvmesh::DecodeItems::DecodeItems(int64_t batch, int64_t heads, int64_t kv_heads, int64_t threads)
    : kv_heads(kv_heads), group(heads / kv_heads) {
  slices = std::clamp<int64_t>((2 * threads + batch * kv_heads - 1) / (batch * kv_heads), 1, group);
  per = (group + slices - 1) / slices;
  count = batch * kv_heads * slices;
}

void kvmesh::DecodeItems::run(const PagedKV& kv, const DecodeRows& rows, int64_t item,
                              int64_t end) const {
  const int64_t b = item / (kv_heads * slices), rest = item % (kv_heads * slices);
  const int64_t kvh = rest / slices, h0 = kvh * group + (rest % slices) * per;
  const int64_t h1 = std::min(h0 + per, (kvh + 1) * group);
  // the next item this thread runs, whose first pages it asks for ahead (-1: none)
  const int64_t next = item + 1 < end ? item + 1 : -1;
  const int next_b = next < 0 ? -1 : (int)(next / (kv_heads * slices));
  const int next_kvh = next < 0 ? 0 : (int)(next % (kv_heads * slices) / slices);
  if (h0 < h1) kvmesh::paged_decode_item(kv, rows, (int)b, (int)kvh, (int)h0, (int)h1, next_b, next_kvh);
}
