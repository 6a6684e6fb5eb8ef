// torch bindings of the CPU kernels: argument checks, then the work split over torch's threads.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "kernels.h"
#include "ops.h"
#include "phases.h"
#include "simd.h"

// q [B, H, k_dim]; data [pages, kv_heads, page_size, parts, dim] (a view into the pool);
// exps [pages, kv_heads, page_size, parts] int8 for FP8; block_tables [B, W] int32;
// lengths [B] int32 -> [B, H, v_dim] in q's dtype.
torch::Tensor kvmesh::paged_decode(torch::Tensor q, torch::Tensor data, c10::optional<torch::Tensor> exps,
                           torch::Tensor block_tables, torch::Tensor lengths, int64_t k_part,
                           int64_t v_part, int64_t v_dim, double scale) {
  TORCH_CHECK(q.dim() == 3 && data.dim() == 5, "q [B, H, D] and pages [P, Hkv, S, parts, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16,
              "q must be fp32 or bf16");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && lengths.scalar_type() == torch::kInt,
              "block tables and lengths must be int32");
  TORCH_CHECK(data.stride(4) == 1 && q.stride(2) == 1, "rows must be contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = data.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) <= data.size(4) && v_dim <= data.size(4), "dims exceed the page rows");
  block_tables = block_tables.contiguous();
  lengths = lengths.contiguous();
  const kvmesh::PagedKV kv = kvmesh::paged_kv(data, exps, k_part, v_part, q.size(2), v_dim);
  auto out = torch::empty({batch, heads, v_dim}, q.options());
  if (batch == 0) return out;
  TORCH_CHECK(block_tables.size(0) == batch && lengths.size(0) == batch, "one table and length per row");
  kvmesh::DecodeRows rows{};
  rows.q = q.data_ptr(), rows.bf16 = q.scalar_type() == torch::kBFloat16;
  rows.q_row = q.stride(0), rows.q_head = q.stride(1);
  rows.out = out.data_ptr(), rows.out_row = out.stride(0), rows.out_head = out.stride(1);
  rows.block_tables = block_tables.data_ptr<int32_t>(), rows.table_row = block_tables.stride(0);
  rows.lengths = lengths.data_ptr<int32_t>();
  rows.num_heads = (int)heads, rows.num_kv_heads = (int)kv_heads, rows.scale = (float)scale;
  const kvmesh::DecodeItems items(batch, heads, kv_heads, at::get_num_threads());
  at::parallel_for(0, items.count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) items.run(kv, rows, item, end);
  });
  return out;
}

namespace kvmesh::ops {

// x [B, K] bf16, w [N, K] bf16 -> [B, N] bf16 (+ bias [N] bf16); the weights are read from
// memory once whatever B (above 8 rows in register tiles over L2-resident blocks of them).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "bf16 inputs only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [B, K] and w [N, K]");
  x = x.contiguous();
  TORCH_CHECK(w.stride(1) == 1, "weight rows must be contiguous");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous(), "bf16 bias");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  const int64_t batch = x.size(0), n = w.size(0), k = w.size(1);
  auto y = torch::empty({batch, n}, x.options());
  if (batch == 0 || n == 0) return y;
  auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  static const bool dot = kvmesh::cpu_has_bf16_dot();
  if (batch <= 8) {  // 64-row chunks claimed (phases.h): a descheduled thread holds no one up
    kvmesh::run_chunks((n + 63) / 64, at::get_num_threads(), [&](int64_t c) {
      kvmesh::gemv_bf16(xp, k, (int)batch, wp, w.stride(0), k, b, yp, n, c * 64,
                        std::min(c * 64 + 64, n), dot);
    });
    return y;
  }
  at::parallel_for(0, (n + 15) / 16, 8, [&](int64_t begin, int64_t end) {
    kvmesh::gemv_bf16(xp, k, (int)batch, wp, w.stride(0), k, b, yp, n, begin * 16,
                      std::min(end * 16, n), dot);
  });
  return y;
}

// x [B, K] fp32, w [N, K] fp32 -> [B, N] fp32 (+ bias [N] fp32), B <= gemv_f32_max_batch():
// the weights read from memory once (gemv_f32.cpp).
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "fp32 inputs only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [B, K] and w [N, K]");
  TORCH_CHECK(x.size(0) <= kvmesh::gemv_f32_max_batch(), "at most ",
              kvmesh::gemv_f32_max_batch(), " rows");
  x = x.contiguous();
  TORCH_CHECK(w.stride(1) == 1, "weight rows must be contiguous");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous(), "fp32 bias");
    b = bias->data_ptr<float>();
  }
  const int64_t batch = x.size(0), n = w.size(0), k = w.size(1);
  auto y = torch::empty({batch, n}, x.options());
  if (batch == 0 || n == 0) return y;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n + 15) / 16, 8, [&](int64_t begin, int64_t end) {
    kvmesh::gemv_f32(xp, k, (int)batch, wp, w.stride(0), k, b, yp, n, begin * 16,
                     std::min(end * 16, n));
  });
  return y;
}

// The same product on AMX tiles (amx_linear.cpp): B <= 64, K % 32 == 0, N % 16 == 0.
torch::Tensor linear_bf16_amx(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kvmesh::cpu_has_amx(), "this CPU (or kernel) offers no AMX");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "bf16 inputs only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [B, K] and w [N, K]");
  const int64_t batch = x.size(0), n = w.size(0), k = w.size(1);
  TORCH_CHECK(batch <= 64 && k % 32 == 0 && n % 16 == 0, "B <= 64, K % 32 == 0, N % 16 == 0");
  TORCH_CHECK(w.stride(1) == 1, "weight rows must be contiguous");
  x = x.contiguous();
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous(), "bf16 bias");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  auto y = torch::empty({batch, n}, x.options());
  if (batch == 0 || n == 0) return y;
  auto packed = torch::empty({(batch + 15) / 16 * (k / 32) * 512}, x.options());
  auto* pp = reinterpret_cast<uint16_t*>(packed.data_ptr());
  kvmesh::amx_pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr()), k, (int)batch, k, pp);
  auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, n / 16, 2, [&](int64_t begin, int64_t end) {
    kvmesh::amx_linear_rows(pp, (int)batch, wp, w.stride(0), k, b, yp, n, begin, end);
  });
  return y;
}

// x [B, K] (B <= 4), packed [N / block, K, block / 2] uint8 (torch's CPU int4pack, its row
// blocks 32 or 64), scales_zeros [K / group, N, 2] in x's dtype -> [B, N] in x's dtype.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, int64_t group,
                          torch::Tensor scales_zeros, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= 16, "x [B, K] with B <= 16");
  TORCH_CHECK(x.scalar_type() == scales_zeros.scalar_type(), "x and scales must share a dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "x must be fp32 or bf16");
  const int64_t batch = x.size(0), k = x.size(1), n = scales_zeros.size(1);
  TORCH_CHECK(block == 32 || block == 64, "row blocks of 32 or 64");
  TORCH_CHECK(k % group == 0 && group % 16 == 0 && n % block == 0, "shape not in row blocks");
  TORCH_CHECK(packed.numel() == n * k / 2 && packed.is_contiguous(), "packed weight size");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.size(0) == k / group, "scales shape");
  auto y = torch::empty({batch, n}, x.options());
  if (batch == 0) return y;
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  static const bool dot = kvmesh::cpu_has_int4_dot();
  kvmesh::Int4Gemv g{nullptr, nullptr, nullptr, (int)batch, packed.data_ptr<uint8_t>(),
                     (int)block, scales_zeros.data_ptr(), bf16, n, k, group, y.data_ptr()};
  torch::Tensor xs, sums;  // held until the kernel is done
  if (bf16 && dot && block == 64) {  // x as it is (int4_gemv.cpp)
    xs = x.contiguous();
    g.x_bf16 = reinterpret_cast<const uint16_t*>(xs.data_ptr());
  } else {
    xs = x.to(torch::kFloat).contiguous();
    sums = xs.view({batch, k / group, group}).sum(-1).contiguous();
    g.x = xs.data_ptr<float>(), g.group_sums = sums.data_ptr<float>();
  }
  at::parallel_for(0, n / block, 256 / block, [&](int64_t begin, int64_t end) {
    kvmesh::int4_gemv_blocks(g, begin, end);
  });
  return y;
}

// rms_norm(x) or, with residual, (rms_norm(x + residual), x + residual); x [rows, dim].
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "contiguous [rows, dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && weight.numel() == x.size(1),
              "weight [dim] in x's dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "fp32 or bf16");
  auto out = torch::empty_like(x);
  torch::Tensor sum;
  kvmesh::NormRows r{x.data_ptr(), nullptr, weight.data_ptr(), out.data_ptr(), nullptr,
                     x.scalar_type() == torch::kBFloat16, x.size(1), (float)eps};
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(), "residual like x");
    sum = torch::empty_like(x);
    r.residual = residual->data_ptr(), r.sum_out = sum.data_ptr();
  }
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, x.size(1)));
  at::parallel_for(0, x.size(0), grain, [&](int64_t b, int64_t e) { kvmesh::rms_norm_rows(r, b, e); });
  if (residual.has_value()) return {out, sum};
  return {out};
}

// logits [rows, V] fp32 or bf16 -> int64 [rows]: the first index of each row's maximum, -1 for
// a row holding NaN (the caller asks torch about those).
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits [rows, V], rows contiguous");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16,
              "fp32 or bf16 logits");
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kLong));
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, logits.size(0), 1, [&](int64_t b, int64_t e) {
    kvmesh::argmax_rows(logits.data_ptr(), bf16, logits.size(1), logits.stride(0),
                        out.data_ptr<int64_t>(), b, e);
  });
  return out;
}

// x [T, H, D] (any row / head strides, D contiguous), cos / sin [T, D] contiguous, same dtype
// -> [T, H, D] contiguous: models/rope.apply_rotary bit for bit.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x [T, H, D] with even D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel(), "cos / sin [T, D]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "fp32 or bf16, one dtype");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  kvmesh::RopeRows r{x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                     x.scalar_type() == torch::kBFloat16, (int)x.size(1), x.size(2), x.stride(0),
                     x.stride(1), out.stride(0)};
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) { kvmesh::rope_rows(r, b, e); });
  return out;
}

// Split so that each op has a fixed number of outputs (graph capture needs fake shapes).
// fp32 rows go to torch's fused rms_norm (the eager step's bits; the kernel's reduction order
// differs): one op either way, so a compiler keeps them as they are.
torch::Tensor rms_norm_only(torch::Tensor x, torch::Tensor weight, double eps) {
  if (x.scalar_type() == torch::kFloat) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  return rms_norm(x, weight, eps, c10::nullopt)[0];
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps) {
  if (x.scalar_type() == torch::kFloat) {
    auto total = x + residual;
    return {at::rms_norm(total, {x.size(-1)}, weight, eps), total};
  }
  auto both = rms_norm(x, weight, eps, residual);
  return {both[0], both[1]};
}

bool has_bf16_dot() { return kvmesh::cpu_has_bf16_dot(); }
// Tests only: thread 1 of a phase sleeps this long before its first chunk (phases.h).
void set_phase_delay_us(int64_t us) { kvmesh::test_delay_us.store(us); }
bool has_amx() { return kvmesh::cpu_has_amx(); }

// silu(gate) * up of fused gate|up rows: torch's own ops (its exp), one op in a graph so that a
// compiler does not re-derive them. Blocks of whole rows per thread: torch's own split of a large
// tensor lands mid-row, and its vector loop then leaves other lanes to the scalar exp, so the
// bits would depend on the thread count (decoder_rows.cpp splits rows at 64 columns, the same
// lanes as whole rows).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  auto parts = gate_up.chunk(2, -1);
  const int64_t width = parts[0].size(-1), rows = width ? parts[0].numel() / width : 0;
  auto out = at::empty(parts[0].sizes(), parts[0].options());
  const auto gate = parts[0].reshape({rows, width}), up = parts[1].reshape({rows, width});
  const auto flat = out.view({rows, width});
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: each thread's own
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)),
                   [&](int64_t begin, int64_t end) {
                     c10::InferenceMode guard(inference);
                     auto o = flat.slice(0, begin, end);
                     at::silu_out(o, gate.slice(0, begin, end));
                     at::mul_out(o, o, up.slice(0, begin, end));
                   });
  return out;
}

}  // namespace kvmesh::ops

// Dispatcher ops (torch.ops.kvmesh.*): eager calls and torch.compile graphs call the same C++;
// their fake (shape) functions are in kernels/fake.py.
TORCH_LIBRARY(kvmesh, m) {
  m.def("paged_decode(Tensor q, Tensor data, Tensor? exps, Tensor block_tables, Tensor lengths, "
        "int k_part, int v_part, int v_dim, float scale) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_bf16_amx(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, int group, Tensor scales_zeros, int block) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("has_bf16_dot() -> bool", &kvmesh::ops::has_bf16_dot);
  m.def("has_amx() -> bool", &kvmesh::ops::has_amx);
  m.def("set_phase_delay_us(int us) -> ()", &kvmesh::ops::set_phase_delay_us);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("paged_decode", &kvmesh::paged_decode);
  m.impl("linear_bf16", &kvmesh::ops::linear_bf16);
  m.impl("linear_bf16_amx", &kvmesh::ops::linear_bf16_amx);
  m.impl("linear_f32", &kvmesh::ops::linear_f32);
  m.impl("int4_linear", &kvmesh::ops::int4_linear);
  m.impl("rms_norm", &kvmesh::ops::rms_norm_only);
  m.impl("add_rms_norm", &kvmesh::ops::add_rms_norm);
  m.impl("argmax_rows", &kvmesh::ops::argmax_rows);
  m.impl("rope", &kvmesh::ops::rope);
  m.impl("silu_mul", &kvmesh::ops::silu_mul);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}  // importing the module registers the ops above
