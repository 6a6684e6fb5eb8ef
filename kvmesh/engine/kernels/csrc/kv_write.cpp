// Writing a step's new KV rows into their pages, and the decode attention that follows, as one
// op. Pages are reached by a layer key (register_layer), not passed in: a compiled graph then
// has no pool views among its inputs to mutate (engine/compiled.py).
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/extension.h>

#include <cmath>
#include <mutex>
#include <unordered_map>

#include "kv_pages.h"
#include "ops.h"

namespace {

using kvmesh::kv::Pages;

std::mutex registry_mutex;
std::unordered_map<int64_t, Pages>& registry() {
  static std::unordered_map<int64_t, Pages> layers;
  return layers;
}

void register_layer(int64_t key, torch::Tensor data, c10::optional<torch::Tensor> exps) {
  TORCH_CHECK(data.dim() == 5 && data.stride(4) == 1, "pages [P, heads, page_size, parts, dim]");
  std::lock_guard<std::mutex> hold(registry_mutex);
  registry()[key] = Pages{data, exps};
}

void forget_layer(int64_t key) {
  std::lock_guard<std::mutex> hold(registry_mutex);
  registry().erase(key);
}

constexpr float kFp8Max = 448.0f;
constexpr int kExpMin = -110, kExpMax = 110;

// One row of `dim` values into one slot's part: stored as is, rounded to bf16, or FP8 e4m3 with
// its power-of-two exponent (kv_fp8.quantize, the same bytes).
template <typename In>
void store_row(const In* x, int64_t dim, const Pages& p, int64_t page, int64_t head, int64_t slot,
               int64_t part) {
  const auto& d = p.data;
  char* base = static_cast<char*>(d.data_ptr()) +
               (page * d.stride(0) + head * d.stride(1) + slot * d.stride(2) + part * d.stride(3)) *
                   d.element_size();
  switch (d.scalar_type()) {
    case torch::kFloat: {
      auto* out = reinterpret_cast<float*>(base);
      for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<float>(x[i]);
      break;
    }
    case torch::kBFloat16: {
      auto* out = reinterpret_cast<c10::BFloat16*>(base);
      for (int64_t i = 0; i < dim; ++i) out[i] = c10::BFloat16(static_cast<float>(x[i]));
      break;
    }
    case torch::kChar: {
      float amax = 0.0f;
      for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
      int exponent = 0;
      std::frexp(amax / kFp8Max, &exponent);
      exponent = std::min(std::max(exponent, kExpMin), kExpMax);
      const float inverse = std::exp2(static_cast<float>(-exponent));
      auto* out = reinterpret_cast<c10::Float8_e4m3fn*>(base);
      for (int64_t i = 0; i < dim; ++i) out[i] = c10::Float8_e4m3fn(static_cast<float>(x[i]) * inverse);
      const auto& e = *p.exps;
      e.data_ptr<int8_t>()[page * e.stride(0) + head * e.stride(1) + slot * e.stride(2) +
                           part * e.stride(3)] = static_cast<int8_t>(exponent);
      break;
    }
    default: TORCH_CHECK(false, "pages must be fp32, bf16 or fp8 bytes");
  }
}

template <typename In>
void store_rows(const torch::Tensor& fresh, const int64_t* page, const int64_t* offset,
                const Pages& p) {
  const int64_t rows = fresh.size(0), heads = fresh.size(1), parts = fresh.size(2);
  const int64_t dim = fresh.size(3);
  const In* x = fresh.data_ptr<In>();
  at::parallel_for(0, rows * heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      for (int64_t part = 0; part < parts; ++part) {
        store_row(x + ((t * heads + h) * parts + part) * dim, dim, p, page[t], h, offset[t], part);
      }
    }
  });
}

}  // namespace

kvmesh::kv::Pages kvmesh::kv::pages_of(int64_t key) {
  std::lock_guard<std::mutex> hold(registry_mutex);
  auto found = registry().find(key);
  TORCH_CHECK(found != registry().end(), "no KV layer registered under key ", key);
  return found->second;
}

void kvmesh::kv::store_bf16_row(const c10::BFloat16* x, int64_t dim, const Pages& p, int64_t page,
                                int64_t head, int64_t slot, int64_t part) {
  store_row(x, dim, p, page, head, slot, part);
}

// fresh [T, heads, parts, dim] (fp32 or bf16) written at slots (page[t], offset[t]) of the layer
// registered under `key`; then q [B, H, k_dim] (the first B rows) attended -> [B, H, v_dim].
torch::Tensor kvmesh::ops::paged_write_decode(torch::Tensor q, torch::Tensor fresh, int64_t key,
                                              torch::Tensor page, torch::Tensor offset,
                                              torch::Tensor block_tables, torch::Tensor lengths,
                                              int64_t v_part, int64_t v_dim, double scale) {
  const Pages p = kvmesh::kv::pages_of(key);
  TORCH_CHECK(fresh.dim() == 4 && fresh.size(1) == p.data.size(1) &&
                  fresh.size(2) == p.data.size(3) && fresh.size(3) == p.data.size(4),
              "new rows [T, heads, parts, dim] like the pages");
  TORCH_CHECK(page.scalar_type() == torch::kLong && offset.scalar_type() == torch::kLong &&
                  page.numel() == fresh.size(0) && offset.numel() == fresh.size(0),
              "one int64 (page, offset) per new row");
  TORCH_CHECK(p.data.scalar_type() != torch::kChar || p.exps.has_value(), "FP8 pages need exps");
  fresh = fresh.contiguous();
  page = page.contiguous();
  offset = offset.contiguous();
  const int64_t num_pages = p.data.size(0), page_size = p.data.size(2);
  const int64_t* pg = page.data_ptr<int64_t>();
  const int64_t* off = offset.data_ptr<int64_t>();
  for (int64_t t = 0; t < page.numel(); ++t) {
    TORCH_CHECK(pg[t] >= 0 && pg[t] < num_pages && off[t] >= 0 && off[t] < page_size,
                "slot (", pg[t], ", ", off[t], ") outside the pages");
  }
  if (fresh.scalar_type() == torch::kFloat) {
    store_rows<float>(fresh, pg, off, p);
  } else {
    TORCH_CHECK(fresh.scalar_type() == torch::kBFloat16, "new rows must be fp32 or bf16");
    store_rows<c10::BFloat16>(fresh, pg, off, p);
  }
  return kvmesh::paged_decode(q.contiguous(), p.data, p.exps, block_tables, lengths, 0, v_part,
                              v_dim, scale);
}

namespace {

// The op takes the layer key as a one-element tensor: a compiled graph holds it as an input.
torch::Tensor paged_write_decode_op(torch::Tensor q, torch::Tensor fresh, torch::Tensor key,
                                    torch::Tensor page, torch::Tensor offset,
                                    torch::Tensor block_tables, torch::Tensor lengths,
                                    int64_t v_part, int64_t v_dim, double scale) {
  TORCH_CHECK(key.numel() == 1 && key.scalar_type() == torch::kLong, "layer key: one int64");
  return kvmesh::ops::paged_write_decode(q, fresh, key.item<int64_t>(), page, offset,
                                         block_tables, lengths, v_part, v_dim, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("register_layer(int key, Tensor data, Tensor? exps) -> ()", &register_layer);
  m.def("forget_layer(int key) -> ()", &forget_layer);
  m.def("paged_write_decode(Tensor q, Tensor fresh, Tensor key, Tensor page, Tensor offset, "
        "Tensor block_tables, Tensor lengths, int v_part, int v_dim, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("paged_write_decode", &paged_write_decode_op); }
