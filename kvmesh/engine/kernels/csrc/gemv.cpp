// Small-batch bf16 linears that stream the weights at memory speed. Up to 4 batch rows: one weight
// row at a time against every batch row, so each thread reads its rows as one sequential stream
// that the hardware prefetchers follow (four rows side by side, each 8 rows ahead by software
// prefetch, read SmolLM2's small matrices 15-20 % slower on the AVX-512 EPYC). 5-8 batch rows: 2
// weight rows at a time, prefetched. More rows: register tiles of 4 weight rows x 6 batch
// rows over blocks of weight rows that stay in L2 while every tile of batch rows passes over
// them (on AVX2, with half the registers: one weight row x 6 batch rows, x widened once).
// Every way, each output is one fp32 accumulator per 32 k, fed in k order, then hsum: a row's
// bits do not depend on the batch it came in (bf16_dot.h).
#include <algorithm>
#include <vector>

#include "bf16_dot.h"
#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

// Rows of prefetch distance where several rows are read side by side (~9 KB for K = 576;
// docs/benchmarks.md). The lines are asked for into L2, not L1: an L1 prefetch holds one of L1's
// few miss buffers until its line arrives.
constexpr int kAhead = 8;

inline float bias_at(const uint16_t* bias, int64_t n) {
  if (!bias) return 0.0f;  // added all the same: -0 + 0 = +0, as with a bias of zero
  float add;
  uint32_t u = (uint32_t)bias[n] << 16;
  __builtin_memcpy(&add, &u, 4);
  return add;
}

template <int kRows, int kBatch, bool kDot, bool kPrefetch>
KVMESH_BF16_DOT_TARGET void block(const uint16_t* x, int64_t ldx,
                                                 const uint16_t* w, int64_t ldw, int64_t k,
                                                 const uint16_t* bias, uint16_t* y, int64_t ldy,
                                                 int64_t n) {
  // every loop over accumulators unrolled: an index the compiler cannot resolve keeps them in
  // memory, stored after every dot product (GCC did so at 2 x 5 to 4 x 4 accumulators)
  Vec acc[kRows][kBatch];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < kBatch; ++b) acc[r][b] = zero();
  for (int64_t i = 0; i < k; i += 32) {
    Bf32 xs[kBatch];
#pragma GCC unroll 8
    for (int b = 0; b < kBatch; ++b) xs[b] = load_bf32(x + b * ldx + i, k - i);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      // the same line kAhead rows on: rows side by side are streams the hardware follows badly
      if constexpr (kPrefetch)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + kAhead) * ldw + i), _MM_HINT_T1);
      const Bf32 ws = load_bf32(w + (n + r) * ldw + i, k - i);
#pragma GCC unroll 8
      for (int b = 0; b < kBatch; ++b) acc[r][b] = dot32<kDot>(acc[r][b], ws, xs[b]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const float add = bias_at(bias, n + r);
#pragma GCC unroll 8
    for (int b = 0; b < kBatch; ++b) y[b * ldy + n + r] = to_bf16(hsum(acc[r][b]) + add);
  }
}

template <int kBatch, bool kDot>
void rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k,
          const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int kRows = kBatch <= 4 ? 1 : 2;
  constexpr bool kPrefetch = kRows > 1;
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows)
    block<kRows, kBatch, kDot, kPrefetch>(x, ldx, w, ldw, k, bias, y, ldy, n);
  for (; n < n1; ++n) block<1, kBatch, kDot, kPrefetch>(x, ldx, w, ldw, k, bias, y, ldy, n);
}

template <bool kDot>
void dispatch(const uint16_t* x, int64_t ldx, int batch, const uint16_t* w, int64_t ldw, int64_t k,
              const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  switch (batch) {
    case 1: return rows<1, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 2: return rows<2, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 3: return rows<3, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 4: return rows<4, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 5: return rows<5, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 6: return rows<6, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 7: return rows<7, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    default: return rows<8, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
  }
}

// ---- more than 8 batch rows: register tiles over L2-resident blocks of weight rows ----

constexpr int kTileRows = 4, kTileBatch = 6;  // 24 accumulators + 4 weight vectors + 1 x

template <int kR, int kB, bool kDot>
KVMESH_BF16_DOT_TARGET void tile(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                                int64_t ldw, int64_t k, bool prefetch,
                                                const uint16_t* bias, uint16_t* y, int64_t ldy,
                                                int64_t n) {
  Vec acc[kR][kB];
  for (int r = 0; r < kR; ++r)
    for (int b = 0; b < kB; ++b) acc[r][b] = zero();
  const uint16_t* wn = w + n * ldw;
  for (int64_t i = 0; i < k; i += 32) {
    Bf32 ws[kR];
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      if (prefetch)  // the first batch tile brings the block in from memory
        _mm_prefetch(reinterpret_cast<const char*>(wn + (r + kAhead) * ldw + i), _MM_HINT_T1);
      ws[r] = load_bf32(wn + r * ldw + i, k - i);
    }
#pragma GCC unroll 8
    for (int b = 0; b < kB; ++b) {
      const Bf32 xs = load_bf32(x + b * ldx + i, k - i);
#pragma GCC unroll 8
      for (int r = 0; r < kR; ++r) acc[r][b] = dot32<kDot>(acc[r][b], ws[r], xs);
    }
  }
  // every loop over accumulators unrolled: an index the compiler cannot resolve would keep
  // them in memory, stored on every k step
  constexpr int kGroups = (kR * kB + 15) / 16;
  Vec all[kGroups * 16];
#pragma GCC unroll 64
  for (int j = 0; j < kGroups * 16; ++j) all[j] = j < kR * kB ? acc[j / kB][j % kB] : zero();
  float sums[kGroups * 16];
#pragma GCC unroll 4
  for (int g = 0; g < kGroups; ++g) hsum16x16(all + 16 * g, sums + 16 * g);
  for (int r = 0; r < kR; ++r) {
    const float add = bias_at(bias, n + r);
    for (int b = 0; b < kB; ++b) y[b * ldy + n + r] = to_bf16(sums[r * kB + b] + add);
  }
}

template <int kB, bool kDot>
void tile_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k,
               bool prefetch, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0,
               int64_t n1) {
  int64_t n = n0;
  for (; n + kTileRows <= n1; n += kTileRows)
    tile<kTileRows, kB, kDot>(x, ldx, w, ldw, k, prefetch, bias, y, ldy, n);
  for (; n < n1; ++n) tile<1, kB, kDot>(x, ldx, w, ldw, k, prefetch, bias, y, ldy, n);
}

template <bool kDot>
void tiled(const uint16_t* x, int64_t ldx, int batch, const uint16_t* w, int64_t ldw, int64_t k,
           const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  // ~128 KB of weight rows per block: in L2 for every batch tile after the first
  const int64_t block_rows = std::max<int64_t>(kTileRows, (65536 / k) / kTileRows * kTileRows);
  for (int64_t nb = n0; nb < n1; nb += block_rows) {
    const int64_t ne = std::min(nb + block_rows, n1);
    for (int b = 0; b < batch; b += kTileBatch) {
      const uint16_t* xb = x + b * ldx;
      uint16_t* yb = y + b * ldy;
      const bool first = b == 0;
      switch (std::min(kTileBatch, batch - b)) {
        case 1: tile_rows<1, kDot>(xb, ldx, w, ldw, k, first, bias, yb, ldy, nb, ne); break;
        case 2: tile_rows<2, kDot>(xb, ldx, w, ldw, k, first, bias, yb, ldy, nb, ne); break;
        case 3: tile_rows<3, kDot>(xb, ldx, w, ldw, k, first, bias, yb, ldy, nb, ne); break;
        case 4: tile_rows<4, kDot>(xb, ldx, w, ldw, k, first, bias, yb, ldy, nb, ne); break;
        case 5: tile_rows<5, kDot>(xb, ldx, w, ldw, k, first, bias, yb, ldy, nb, ne); break;
        default: tile_rows<6, kDot>(xb, ldx, w, ldw, k, first, bias, yb, ldy, nb, ne); break;
      }
    }
  }
}

#if !defined(__AVX512F__)
// ---- AVX2, more than 4 batch rows: 16 ymm registers hold 8 Vec, so the tiles above would keep
// their accumulators in memory. Instead one weight row x up to 6 batch rows (12 ymm
// accumulators + the row's 4 widened vectors), x widened to fp32 once per call (each 32-k
// chunk's odd lanes, then its even ones: dot32's order, so the same bits) and read by the FMAs
// from L1.

constexpr int kWideBatch = 6;

void widen_x(const uint16_t* x, int64_t ldx, int batch, int64_t k, float* out) {
  const int64_t chunks = (k + 31) / 32;
  for (int b = 0; b < batch; ++b)
    for (int64_t c = 0; c < chunks; ++c) {
      const Bf32 xs = load_bf32(x + b * ldx + 32 * c, k - 32 * c);
      float* o = out + (b * chunks + c) * 32;
      storeu(o, bf16_odd(xs));
      storeu(o + 16, bf16_even(xs));
    }
}

template <int kB>
void wide_row(const float* xw, int64_t k, const uint16_t* w, int64_t ldw, bool prefetch,
              const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n) {
  const int64_t chunks = (k + 31) / 32;
  Vec acc[kB];
#pragma GCC unroll 8
  for (int b = 0; b < kB; ++b) acc[b] = zero();
  const uint16_t* wn = w + n * ldw;
  const auto chunk = [&](int64_t c, int64_t valid) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wn + kAhead * ldw + 32 * c), _MM_HINT_T1);
    const Bf32 ws = load_bf32(wn + 32 * c, valid);
    const Vec odd = bf16_odd(ws), even = bf16_even(ws);
#pragma GCC unroll 8
    for (int b = 0; b < kB; ++b) {
      const float* xb = xw + (b * chunks + c) * 32;
      acc[b] = fmadd(even, loadu(xb + 16), fmadd(odd, loadu(xb), acc[b]));
    }
  };
  const int64_t whole = k / 32;  // the loop without the tail's branch keeps acc in registers
  for (int64_t c = 0; c < whole; ++c) chunk(c, 32);
  if (whole < chunks) chunk(whole, k - 32 * whole);
  const float add = bias_at(bias, n);
  for (int b = 0; b < kB; ++b) y[b * ldy + n] = to_bf16(hsum(acc[b]) + add);
}

void wide_tiled(const uint16_t* x, int64_t ldx, int batch, const uint16_t* w, int64_t ldw,
                int64_t k, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  thread_local std::vector<float> widened;
  const int64_t chunks = (k + 31) / 32;
  widened.resize((size_t)batch * chunks * 32);
  widen_x(x, ldx, batch, k, widened.data());
  const int64_t block_rows = std::max<int64_t>(1, 65536 / k);  // ~128 KB of weight rows in L2
  for (int64_t nb = n0; nb < n1; nb += block_rows) {
    const int64_t ne = std::min(nb + block_rows, n1);
    for (int b = 0; b < batch; b += kWideBatch) {
      const float* xb = widened.data() + b * chunks * 32;
      uint16_t* yb = y + b * ldy;
      const bool first = b == 0;
      for (int64_t n = nb; n < ne; ++n) switch (std::min(kWideBatch, batch - b)) {
          case 1: wide_row<1>(xb, k, w, ldw, first, bias, yb, ldy, n); break;
          case 2: wide_row<2>(xb, k, w, ldw, first, bias, yb, ldy, n); break;
          case 3: wide_row<3>(xb, k, w, ldw, first, bias, yb, ldy, n); break;
          case 4: wide_row<4>(xb, k, w, ldw, first, bias, yb, ldy, n); break;
          case 5: wide_row<5>(xb, k, w, ldw, first, bias, yb, ldy, n); break;
          default: wide_row<6>(xb, k, w, ldw, first, bias, yb, ldy, n); break;
        }
    }
  }
}
#endif

}  // namespace

#if defined(__AVX512F__)
bool cpu_has_bf16_dot() { return __builtin_cpu_supports("avx512bf16"); }
#else
bool cpu_has_bf16_dot() { return false; }
#endif

void gemv_bf16(const uint16_t* x, int64_t ldx, int batch, const uint16_t* w, int64_t ldw,
               int64_t k, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1,
               bool dot_bf16) {
#if !defined(__AVX512F__)
  if (batch > 4) return wide_tiled(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1);
#endif
  if (batch > 8)
    return dot_bf16 ? tiled<true>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1)
                    : tiled<false>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1);
  if (dot_bf16)
    dispatch<true>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1);
  else
    dispatch<false>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1);
}

}  // namespace kvmesh
