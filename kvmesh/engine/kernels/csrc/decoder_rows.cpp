// The fused decode step of bf16 rows in one OpenMP parallel region, where decoder.cpp's op-by-op
// path would open one (and allocate, and dispatch) per op: per layer the threads split each
// linear's output rows, the new rows' RoPE and KV writes, the attention's items and the SiLU's
// columns between barriers, and each thread computes the norms and the residual add itself
// into its own buffers (the same bits in every thread: no barrier for them). The kernels and
// their order are the op-by-op path's, so the bits are the eager step's
// (tests/integration/test_fused_decode.py); at one row it removes most of the step's time that
// is neither a linear nor the attention (docs/benchmarks.md).
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>

#include "claims.h"
#include "decoder.h"
#include "kernels.h"
#include "kv_pages.h"
#include "ops.h"
#include "simd.h"

namespace kvmesh::decoder {
namespace {

using Bf16 = uint16_t;

const Bf16* bf16_of(const torch::Tensor& t) {
  return t.numel() ? reinterpret_cast<const Bf16*>(t.data_ptr()) : nullptr;
}
Bf16* bf16_of(torch::Tensor& t) { return reinterpret_cast<Bf16*>(t.data_ptr()); }
const c10::BFloat16* as_c10(const Bf16* p) { return reinterpret_cast<const c10::BFloat16*>(p); }

// [begin, end) of thread `t` of `nt` over n units
std::pair<int64_t, int64_t> share(int64_t n, int t, int nt) { return {n * t / nt, n * (t + 1) / nt}; }

// torch's bf16 add: the float sum rounded to nearest even (NaN stays NaN)
inline Bf16 add_bf16(Bf16 a, Bf16 b) {
  const uint32_t ua = (uint32_t)a << 16, ub = (uint32_t)b << 16;
  float fa, fb;
  __builtin_memcpy(&fa, &ua, 4);
  __builtin_memcpy(&fb, &ub, 4);
  const float sum = fa + fb;
  return std::isnan(sum) ? (Bf16)0x7FC0 : to_bf16(sum);
}

// One role's linear of one layer: the bf16 GEMV over 16-row units or the INT4 kernel over its
// row blocks (bf16 x as it is), then its bias as decoder.cpp adds it.
struct Product {
  bool int4 = false;
  const Bf16* w = nullptr;
  const Bf16* bias = nullptr;
  Int4Gemv g{};
  int64_t n = 0, k = 0, units = 0;

  Product(const Decoder& d, size_t layer, Role role, int64_t kernel) {
    const torch::Tensor* t = d.role(layer, role);
    bias = bf16_of(t[1]);
    int4 = kernel == kInt4Small;
    if (int4) {
      const int64_t group = d.group(layer, role), block = d.block(layer, role);
      n = t[2].size(1), k = t[2].size(0) * group;
      TORCH_CHECK(block == 64 && group % 16 == 0 && t[0].numel() == n * k / 2 &&
                      t[0].is_contiguous() && t[2].is_contiguous() &&
                      t[2].scalar_type() == torch::kBFloat16,
                  "INT4 weights in 64-row blocks with bf16 scales");
      g = Int4Gemv{nullptr, nullptr, nullptr, 0, t[0].data_ptr<uint8_t>(), 64,
                   t[2].data_ptr(), true, n, k, group, nullptr};
      units = n / 64;
    } else {
      TORCH_CHECK(t[0].scalar_type() == torch::kBFloat16 && t[0].is_contiguous(), "bf16 weights");
      w = bf16_of(t[0]), n = t[0].size(0), k = t[0].size(1), units = (n + 15) / 16;
    }
  }

  // 64 output rows per chunk: 4 of the GEMV's 16-row units, or one INT4 block
  int64_t chunks() const { return int4 ? units : (units + 3) / 4; }

  // y [batch, n] rows of the chunks thread t claims (claims.h) from x [batch, k]
  void run(const Bf16* x, int batch, Bf16* y, Share* shares, int nt, int t) const {
    static const bool dot = cpu_has_bf16_dot();
    Int4Gemv mine = g;
    mine.x_bf16 = x, mine.batch = batch, mine.y = y;
    run_claimed(shares, nt, t, [&](int64_t c) {
      if (!int4) return gemv_bf16(x, k, batch, w, k, k, bias, y, n, c * 64, std::min(c * 64 + 64, n), dot);
      int4_gemv_blocks(mine, c, c + 1);
      if (bias)
        for (int b = 0; b < batch; ++b)
          for (int64_t r = c * 64; r < c * 64 + 64; ++r) y[b * n + r] = add_bf16(y[b * n + r], bias[r]);
    });
  }
};

struct Layer {
  Product qkv, o, gate_up, down;
  kv::Pages pages;
  PagedKV kv;
};

}  // namespace

bool rows_fit(const Decoder& d, const Step& s) {
  if (d.embed.scalar_type() != torch::kBFloat16 || s.ids.numel() == 0) return false;
  static const bool int4_dot = cpu_has_int4_dot();
  for (size_t i = 0; i < d.kv_keys.size(); ++i)
    for (int r = 0; r < 4; ++r) {
      const int64_t kernel = s.kernels[r];
      if (kernel == kInt4Small ? !int4_dot || d.block(i, (Role)r) != 64 : kernel != kGemv) return false;
    }
  return true;
}

std::vector<torch::Tensor> rows_forward(const Decoder& d, const Step& s) {
  const int64_t T = s.ids.numel(), H = d.embed.size(1), hd = d.head_dim, kvh = d.kv_heads;
  const int64_t q_size = d.heads * hd, kv_size = kvh * hd, group = d.heads / kvh;
  const auto bf16 = d.embed.options();
  // everything that can throw happens here, before the region
  TORCH_CHECK(s.ids.scalar_type() == torch::kLong && s.page.scalar_type() == torch::kLong &&
                  s.offset.scalar_type() == torch::kLong && s.page.numel() == T &&
                  s.offset.numel() == T, "int64 ids and one (page, offset) per row");
  TORCH_CHECK(s.cos.scalar_type() == torch::kBFloat16 && s.sin.scalar_type() == torch::kBFloat16 &&
                  s.cos.numel() == T * hd && s.sin.numel() == T * hd, "bf16 cos / sin [T, head_dim]");
  TORCH_CHECK(s.block_tables.scalar_type() == torch::kInt && s.lengths.scalar_type() == torch::kInt &&
                  s.block_tables.size(0) == T && s.lengths.numel() == T,
              "int32 block tables and lengths, one per row");
  const auto ids = s.ids.contiguous(), page = s.page.contiguous(), offset = s.offset.contiguous();
  const auto cos = s.cos.contiguous(), sin = s.sin.contiguous();
  const auto tables = s.block_tables.contiguous(), lengths = s.lengths.contiguous();
  const int64_t *id = ids.data_ptr<int64_t>(), *pg = page.data_ptr<int64_t>();
  const int64_t* off = offset.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < d.embed.size(0), "token id ", id[t], " outside the vocabulary");
  std::vector<Layer> layers;
  layers.reserve(d.kv_keys.size());
  for (size_t i = 0; i < d.kv_keys.size(); ++i) {
    kv::Pages pages = kv::pages_of(d.kv_keys[i]);
    const auto& data = pages.data;
    TORCH_CHECK(data.dim() == 5 && data.size(1) == kvh && data.size(3) == 2 && data.size(4) == hd,
                "pages [P, kv_heads, page_size, 2, head_dim]");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(pg[t] >= 0 && pg[t] < data.size(0) && off[t] >= 0 && off[t] < data.size(2),
                  "slot (", pg[t], ", ", off[t], ") outside the pages");
    const PagedKV kv = paged_kv(data, pages.exps, 0, 1, hd, hd);
    layers.push_back(Layer{Product(d, i, kQkv, s.kernels[kQkv]), Product(d, i, kO, s.kernels[kO]),
                           Product(d, i, kGateUp, s.kernels[kGateUp]),
                           Product(d, i, kDown, s.kernels[kDown]), std::move(pages), kv});
  }
  const int64_t inter = layers[0].down.k, width = q_size + 2 * kv_size;
  for (const Layer& L : layers)
    TORCH_CHECK(L.qkv.k == H && L.qkv.n == width && L.o.k == q_size && L.o.n == H &&
                    L.gate_up.k == H && L.gate_up.n == 2 * inter && L.down.k == inter &&
                    L.down.n == H, "linears of the registered shapes");
  const int nt = std::max(1, at::get_num_threads());
  // shared: each linear's output, RoPE'd q, attention output, SiLU product
  auto qkv = torch::empty({T, width}, bf16), q = torch::empty({T, q_size}, bf16);
  auto attended = torch::empty({T, q_size}, bf16), o = torch::empty({T, H}, bf16);
  auto gate_up = torch::empty({T, 2 * inter}, bf16), act = torch::empty({T, inter}, bf16);
  auto down = torch::empty({T, H}, bf16);
  // per thread: the residual stream h (thread 0's is the output), normed x, sum, normed sum, K
  auto out = torch::empty({T, H}, bf16);
  auto own = torch::empty({nt, 4, T, H}, bf16), k_rot = torch::empty({nt, T, hd}, bf16);
  std::vector<bool> keep(layers.size());  // layers whose outputs are returned, in layer order
  std::vector<torch::Tensor> outs{out};
  for (size_t i = 0; i < layers.size(); ++i) {
    keep[i] = std::find(s.capture.begin(), s.capture.end(), (int64_t)i) != s.capture.end();
    if (keep[i]) outs.push_back(torch::empty({T, H}, bf16));
  }
  // the SiLU's columns per thread, in units of 64 (torch's vector loop splits rows alike)
  std::vector<std::array<torch::Tensor, 3>> silu(nt);
  for (int t = 0; t < nt; ++t) {
    const auto [c0, c1] = share((inter + 63) / 64, t, nt);
    const int64_t lo = std::min(c0 * 64, inter), hi = std::min(c1 * 64, inter);
    silu[t] = {gate_up.narrow(1, lo, hi - lo), gate_up.narrow(1, inter + lo, hi - lo),
               act.narrow(1, lo, hi - lo)};
  }
  // each linear's chunks split over the threads (claims.h): a share per thread, four per layer
  std::vector<Share> shares(layers.size() * 4 * nt);
  for (size_t i = 0; i < layers.size(); ++i) {
    const Product* roles[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
    for (int r = 0; r < 4; ++r) split(&shares[(i * 4 + r) * nt], roles[r]->chunks(), nt);
  }
  DecodeRows rows{};
  rows.q = q.data_ptr(), rows.bf16 = true, rows.q_row = q_size, rows.q_head = hd;
  rows.out = attended.data_ptr(), rows.out_row = q_size, rows.out_head = hd;
  rows.block_tables = tables.data_ptr<int32_t>(), rows.table_row = tables.stride(0);
  rows.lengths = lengths.data_ptr<int32_t>();
  rows.num_heads = (int)d.heads, rows.num_kv_heads = (int)kvh, rows.scale = (float)d.scale;
  const DecodeItems items(T, d.heads, kvh, nt);
  const Bf16* embed = bf16_of(d.embed);
  std::exception_ptr failed;

#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
    c10::InferenceMode inference;  // thread-local: the SiLU's ops write the step's own tensors
    Bf16* h = t == 0 ? bf16_of(out) : bf16_of(own) + (t * 4) * T * H;
    Bf16 *x = bf16_of(own) + (t * 4 + 1) * T * H, *total = x + T * H, *normed = total + T * H;
    Bf16* kr = bf16_of(k_rot) + t * T * hd;
    for (int64_t r = 0; r < T; ++r) std::copy_n(embed + id[r] * H, H, h + r * H);
    size_t captured = 1;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      const torch::Tensor* norms = d.tensors.data() + i * kPerLayer;
      rms_norm_rows(NormRows{h, nullptr, norms[0].data_ptr(), x, nullptr, true, H, (float)d.eps}, 0, T);
      L.qkv.run(x, (int)T, bf16_of(qkv), &shares[i * 4 * nt], nt, t);
#pragma omp barrier
      const auto [w0, w1] = share(T * kvh, t, n_t);  // (row, KV head): its q heads' RoPE, K, V
      for (int64_t item = w0; item < w1; ++item) {
        const int64_t r = item / kvh, head = item % kvh;
        const Bf16* fused = bf16_of(qkv);  // rows of q | k | v
        RopeRows rq{fused + head * group * hd, cos.data_ptr(), sin.data_ptr(),
                    bf16_of(q) + head * group * hd, true, (int)group, hd, width, hd, q_size};
        rope_rows(rq, r, r + 1);
        RopeRows rk{fused + q_size + head * hd, cos.data_ptr(), sin.data_ptr(), kr, true, 1, hd,
                    width, hd, hd};
        rope_rows(rk, r, r + 1);
        const Bf16* v = fused + r * width + q_size + kv_size + head * hd;
        kv::store_bf16_row(as_c10(kr + r * hd), hd, L.pages, pg[r], head, off[r], 0);
        kv::store_bf16_row(as_c10(v), hd, L.pages, pg[r], head, off[r], 1);
      }
#pragma omp barrier
      const auto [a0, a1] = share(items.count, t, n_t);
      for (int64_t item = a0; item < a1; ++item) items.run(L.kv, rows, item, a1);
#pragma omp barrier
      L.o.run(bf16_of(attended), (int)T, bf16_of(o), &shares[(i * 4 + 1) * nt], nt, t);
#pragma omp barrier
      rms_norm_rows(NormRows{h, bf16_of(o), norms[1].data_ptr(), normed, total, true, H, (float)d.eps}, 0, T);
      L.gate_up.run(normed, (int)T, bf16_of(gate_up), &shares[(i * 4 + 2) * nt], nt, t);
#pragma omp barrier
      try {  // silu(gate) * up: torch's own ops (ops::silu_mul), a share of the columns each
        for (int u = t; u < nt; u += n_t) {
          if (silu[u][2].numel() == 0) continue;
          at::silu_out(silu[u][2], silu[u][0]);
          at::mul_out(silu[u][2], silu[u][2], silu[u][1]);
        }
      } catch (...) {
#pragma omp critical
        if (!failed) failed = std::current_exception();
      }
#pragma omp barrier
      L.down.run(bf16_of(act), (int)T, bf16_of(down), &shares[(i * 4 + 3) * nt], nt, t);
#pragma omp barrier
      const Bf16* dn = bf16_of(down);
      for (int64_t e = 0; e < T * H; ++e) h[e] = add_bf16(total[e], dn[e]);
      if (keep[i] && t == 0) std::copy_n(h, T * H, bf16_of(outs[captured]));
      captured += keep[i];
    }
  }
  if (failed) std::rethrow_exception(failed);
  return outs;
}

}  // namespace kvmesh::decoder
