// The fused decode step of bf16 rows in one OpenMP parallel region, where decoder.cpp's op-by-op
// path would open one (and allocate, and dispatch) per op. Per layer, seven phases (phases.h):
// the threads claim the q|k|v linear's 64-row chunks, then the new rows' RoPE and KV writes, the
// attention's items, the o linear's chunks, gate|up's, the SiLU's column ranges and down's;
// between them each thread computes the norms and the residual add itself, into its own
// buffers (the same bits in every thread). Phase outputs are kept per layer, so a thread
// descheduled mid-chunk that finishes it late writes where no one reads any more, while the
// others, after waiting a little, redo its chunk and go on. The kernels and their order are the
// op-by-op path's, so the bits are the eager step's (tests/integration/test_fused_decode.py).
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <memory>

#include "decoder.h"
#include "kernels.h"
#include "kv_pages.h"
#include "ops.h"
#include "phases.h"
#include "simd.h"

namespace kvmesh::decoder {
namespace {

using Bf16 = uint16_t;

const Bf16* bf16_of(const torch::Tensor& t) {
  return t.numel() ? reinterpret_cast<const Bf16*>(t.data_ptr()) : nullptr;
}
Bf16* bf16_of(torch::Tensor& t) { return reinterpret_cast<Bf16*>(t.data_ptr()); }
const c10::BFloat16* as_c10(const Bf16* p) { return reinterpret_cast<const c10::BFloat16*>(p); }


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
    TORCH_CHECK(!bias || (t[1].scalar_type() == torch::kBFloat16 && t[1].is_contiguous() &&
                          t[1].numel() == n), "bf16 biases [out]");
  }

  // 64 output rows per chunk: 4 of the GEMV's 16-row units, or one INT4 block
  int64_t chunks() const { return int4 ? units : (units + 3) / 4; }

  // INT4: x's group sums [batch, k / group] into `sums`, once per thread and phase (not per chunk)
  int64_t groups() const { return int4 ? k / g.group : 0; }
  void prepare(const Bf16* x, int batch, float* sums) const {
    if (int4) int4_group_sums_bf16(x, batch, k, g.group, sums);
  }

  // chunk c of y [batch, n] from x [batch, k] (and, INT4, prepare's sums), final values only
  // (an INT4 product goes through `scratch` [batch, n] when a bias follows)
  void chunk(const Bf16* x, int batch, Bf16* y, int64_t c, Bf16* scratch, const float* sums) const {
    static const bool dot = cpu_has_bf16_dot();
    if (!int4) return gemv_bf16(x, k, batch, w, k, k, bias, y, n, c * 64, std::min(c * 64 + 64, n), dot);
    Int4Gemv mine = g;
    mine.x_bf16 = x, mine.group_sums = sums, mine.batch = batch, mine.y = bias ? scratch : y;
    int4_gemv_blocks(mine, c, c + 1);
    if (bias)
      for (int b = 0; b < batch; ++b)
        for (int64_t r = c * 64; r < c * 64 + 64; ++r) y[b * n + r] = add_bf16(scratch[b * n + r], bias[r]);
  }
};

struct Layer {
  Product qkv, o, gate_up, down;
  kv::Pages pages;
  PagedKV kv;
};

}  // namespace

bool rows_fit(const Decoder& d, const Step& s) {
  // more rows (AVX2 takes the GEMV at any batch) would keep MBs of per-layer outputs a step
  constexpr int64_t kMaxRows = 64;
  if (d.embed.scalar_type() != torch::kBFloat16 || s.ids.numel() == 0 || s.ids.numel() > kMaxRows)
    return false;
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
  TORCH_CHECK(d.embed.is_contiguous(), "a contiguous embedding");
  std::vector<Layer> layers;
  layers.reserve(d.kv_keys.size());
  for (size_t i = 0; i < d.kv_keys.size(); ++i) {
    kv::Pages pages = kv::pages_of(d.kv_keys[i]);
    const auto& data = pages.data;
    TORCH_CHECK(data.dim() == 5 && data.size(1) == kvh && data.size(3) == 2 && data.size(4) == hd &&
                    data.stride(4) == 1, "pages [P, kv_heads, page_size, 2, head_dim]");
    for (int n = 0; n < 2; ++n) {
      const torch::Tensor& norm = d.tensors[i * kPerLayer + n];
      TORCH_CHECK(norm.scalar_type() == torch::kBFloat16 && norm.is_contiguous() &&
                      norm.numel() == H, "bf16 norm weights [hidden]");
    }
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
  const int64_t Lc = (int64_t)layers.size();
  // per layer (phases.h): each linear's output, RoPE'd q, attention output, SiLU product
  auto qkv = torch::empty({Lc, T, width}, bf16), q = torch::empty({Lc, T, q_size}, bf16);
  auto attended = torch::empty({Lc, T, q_size}, bf16), o = torch::empty({Lc, T, H}, bf16);
  auto gate_up = torch::empty({Lc, T, 2 * inter}, bf16), act = torch::empty({Lc, T, inter}, bf16);
  auto down = torch::empty({Lc, T, H}, bf16);
  // per thread: the residual stream h (thread 0's is the output), normed x, sum, normed sum; K
  // after RoPE; an INT4 product before its bias; the SiLU before the product
  auto out = torch::empty({T, H}, bf16), own = torch::empty({nt, 4, T, H}, bf16);
  int64_t widest = 2 * inter;  // the SiLU's, or an INT4 product's before its bias
  for (const Layer& L : layers)
    widest = std::max({widest, L.qkv.n, L.o.n, L.gate_up.n, L.down.n});
  auto k_rot = torch::empty({nt, T, hd}, bf16), scratch = torch::empty({nt, T, widest}, bf16);
  int64_t groups = 0;  // INT4 x group sums per thread
  for (const Layer& L : layers)
    groups = std::max({groups, L.qkv.groups(), L.o.groups(), L.gate_up.groups(), L.down.groups()});
  auto x_sums = torch::empty({nt, T * std::max<int64_t>(groups, 1)}, torch::kFloat);
  std::vector<bool> keep(layers.size());  // layers whose outputs are returned, in layer order
  std::vector<torch::Tensor> outs{out};
  for (size_t i = 0; i < layers.size(); ++i) {
    keep[i] = std::find(s.capture.begin(), s.capture.end(), (int64_t)i) != s.capture.end();
    if (keep[i]) outs.push_back(torch::empty({T, H}, bf16));
  }
  // the SiLU's column ranges, one per thread in units of 64 (ops::silu_mul runs whole rows: the
  // same vector and scalar lanes), as views a thread makes once per step and range (mostly its
  // own) and moves to layer i
  std::vector<std::array<int64_t, 2>> ranges(nt);
  for (int u = 0; u < nt; ++u) {
    const auto [c0, c1] = share((inter + 63) / 64, u, nt);
    ranges[u] = {std::min(c0 * 64, inter), std::min(c1 * 64, inter)};
  }
  std::vector<std::array<torch::Tensor, 4>> silu(nt * nt);  // gate, up, act, silu(gate)
  // seven phases per layer: q|k|v, RoPE + KV writes, attention, o, gate|up, SiLU, down
  constexpr int kPhases = 7;
  const DecodeItems items(T, d.heads, kvh, nt);
  std::vector<int64_t> counts;
  for (const Layer& L : layers)
    for (int64_t c : {L.qkv.chunks(), T * kvh, items.count, L.o.chunks(), L.gate_up.chunks(),
                      (int64_t)nt, L.down.chunks()})
      counts.push_back(c);
  std::vector<Share> shares(counts.size() * nt);
  std::vector<Done> done(counts.size());
  int64_t total_chunks = 0;
  for (int64_t c : counts) total_chunks += c;
  std::unique_ptr<std::atomic<uint8_t>[]> flags(new std::atomic<uint8_t>[total_chunks]());
  Failure failure;  // the first exception a phase's work threw (phases.h)
  std::vector<Phase> phases;
  for (size_t p = 0, at = 0; p < counts.size(); at += counts[p], ++p) {
    split(&shares[p * nt], counts[p], nt);
    phases.push_back(Phase{&shares[p * nt], flags.get() + at, &done[p], counts[p], &failure});
  }
  DecodeRows rows0{};
  rows0.bf16 = true, rows0.q_row = q_size, rows0.q_head = hd, rows0.out_row = q_size, rows0.out_head = hd;
  rows0.block_tables = tables.data_ptr<int32_t>(), rows0.table_row = tables.stride(0);
  rows0.lengths = lengths.data_ptr<int32_t>();
  rows0.num_heads = (int)d.heads, rows0.num_kv_heads = (int)kvh, rows0.scale = (float)d.scale;
  const Bf16* embed = bf16_of(d.embed);

#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    c10::InferenceMode inference;  // thread-local: the SiLU's ops write the step's own tensors
    Bf16* h = t == 0 ? bf16_of(out) : bf16_of(own) + (t * 4) * T * H;
    Bf16 *x = bf16_of(own) + (t * 4 + 1) * T * H, *total = x + T * H, *normed = total + T * H;
    Bf16 *kr = bf16_of(k_rot) + t * T * hd, *mine = bf16_of(scratch) + t * T * widest;
    float* sums = x_sums.data_ptr<float>() + t * x_sums.size(1);
    for (int64_t r = 0; r < T; ++r) std::copy_n(embed + id[r] * H, H, h + r * H);
    size_t captured = 1;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      const Phase* ph = phases.data() + i * kPhases;
      const torch::Tensor* norms = d.tensors.data() + i * kPerLayer;
      Bf16 *qkv_i = bf16_of(qkv) + i * T * width, *q_i = bf16_of(q) + i * T * q_size;
      Bf16 *att_i = bf16_of(attended) + i * T * q_size, *o_i = bf16_of(o) + i * T * H;
      Bf16 *gu_i = bf16_of(gate_up) + i * T * 2 * inter, *act_i = bf16_of(act) + i * T * inter;
      Bf16* down_i = bf16_of(down) + i * T * H;
      rms_norm_rows(NormRows{h, nullptr, norms[0].data_ptr(), x, nullptr, true, H, (float)d.eps}, 0, T);
      L.qkv.prepare(x, (int)T, sums);
      run_phase(ph[0], nt, t, [&](int64_t c) { L.qkv.chunk(x, (int)T, qkv_i, c, mine, sums); });
      run_phase(ph[1], nt, t, [&](int64_t c) {  // (row, KV head): its q heads' RoPE, its K and V
        const int64_t r = c / kvh, head = c % kvh;
        RopeRows rq{qkv_i + head * group * hd, cos.data_ptr(), sin.data_ptr(),
                    q_i + head * group * hd, true, (int)group, hd, width, hd, q_size};
        rope_rows(rq, r, r + 1);
        RopeRows rk{qkv_i + q_size + head * hd, cos.data_ptr(), sin.data_ptr(), kr, true, 1, hd,
                    width, hd, hd};
        rope_rows(rk, r, r + 1);
        const Bf16* v = qkv_i + r * width + q_size + kv_size + head * hd;
        kv::store_bf16_row(as_c10(kr + r * hd), hd, L.pages, pg[r], head, off[r], 0);
        kv::store_bf16_row(as_c10(v), hd, L.pages, pg[r], head, off[r], 1);
      });
      DecodeRows rows = rows0;
      rows.q = q_i, rows.out = att_i;
      run_phase(ph[2], nt, t, [&](int64_t c) { items.run(L.kv, rows, c, items.count); });
      L.o.prepare(att_i, (int)T, sums);
      run_phase(ph[3], nt, t, [&](int64_t c) { L.o.chunk(att_i, (int)T, o_i, c, mine, sums); });
      rms_norm_rows(NormRows{h, o_i, norms[1].data_ptr(), normed, total, true, H, (float)d.eps}, 0, T);
      L.gate_up.prepare(normed, (int)T, sums);
      run_phase(ph[4], nt, t, [&](int64_t c) { L.gate_up.chunk(normed, (int)T, gu_i, c, mine, sums); });
      run_phase(ph[5], nt, t, [&](int64_t u) {  // silu(gate) * up: torch's ops (ops::silu_mul)
        const int64_t lo = ranges[u][0], w = ranges[u][1] - lo;
        if (w == 0) return;
        auto& v = silu[t * nt + u];
        if (!v[0].defined())
          v = {gate_up[0].narrow(1, lo, w), gate_up[0].narrow(1, inter + lo, w),
               act[0].narrow(1, lo, w), scratch[t].narrow(1, 0, w)};
        v[0].unsafeGetTensorImpl()->set_storage_offset(i * T * 2 * inter + lo);
        v[1].unsafeGetTensorImpl()->set_storage_offset(i * T * 2 * inter + inter + lo);
        v[2].unsafeGetTensorImpl()->set_storage_offset(i * T * inter + lo);
        at::silu_out(v[3], v[0]);
        at::mul_out(v[2], v[3], v[1]);
      });
      L.down.prepare(act_i, (int)T, sums);
      run_phase(ph[6], nt, t, [&](int64_t c) { L.down.chunk(act_i, (int)T, down_i, c, mine, sums); });
      for (int64_t e = 0; e < T * H; ++e) h[e] = add_bf16(total[e], down_i[e]);
      if (keep[i] && t == 0) std::copy_n(h, T * H, bf16_of(outs[captured]));
      captured += keep[i];
    }
  }
  failure.rethrow();
  return outs;
}

}  // namespace kvmesh::decoder
