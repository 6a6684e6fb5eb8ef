// Small-batch fp32 linears that stream the weights at memory speed (gemv.cpp's small-batch path
// for fp32 weights). torch's x @ W^T at 2-8 rows re-reads the weight (MKL read ~8 GB/s at 4
// rows on the AVX-512 EPYC, ~20 at one), and every fp32 decode step of a few streams is such a
// product. R weight rows at a time against every batch row; each output is one fp32 accumulator
// per 16 k, fed in k order, then hsum: a row's bits do not depend on the batch it came in.
#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

constexpr int kAhead = 8;  // rows of prefetch distance into L2, as gemv.cpp

template <int kRows, int kBatch>
void block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, const float* bias,
           float* y, int64_t ldy, int64_t n) {
  Vec acc[kRows][kBatch];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < kBatch; ++b) acc[r][b] = zero();
  // one loop, the tail's lanes masked (they load zeros and add nothing)
  for (int64_t i = 0; i < k; i += 16) {
    const int valid = (int)std::min<int64_t>(16, k - i);
    Vec xs[kBatch];
#pragma GCC unroll 8
    for (int b = 0; b < kBatch; ++b) xs[b] = load_f32(x + b * ldx + i, valid);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + kAhead) * ldw + i), _MM_HINT_T1);
      const Vec ws = load_f32(w + (n + r) * ldw + i, valid);
#pragma GCC unroll 8
      for (int b = 0; b < kBatch; ++b) acc[r][b] = fmadd(ws, xs[b], acc[r][b]);
    }
  }
  // unrolled too: an index the compiler cannot resolve keeps acc in memory in the loop above
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const float add = bias ? bias[n + r] : 0.0f;
#pragma GCC unroll 8
    for (int b = 0; b < kBatch; ++b) y[b * ldy + n + r] = hsum(acc[r][b]) + add;
  }
}

template <int kBatch>
void rows(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, const float* bias,
          float* y, int64_t ldy, int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
  constexpr int kRows = kBatch <= 4 ? 4 : 2;  // <= 16 accumulators + the batch's x in 32 zmm
#else
  constexpr int kRows = kBatch <= 1 ? 4 : (kBatch <= 2 ? 2 : 1);  // a Vec is 2 of 16 ymm
#endif
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) block<kRows, kBatch>(x, ldx, w, ldw, k, bias, y, ldy, n);
  for (; n < n1; ++n) block<1, kBatch>(x, ldx, w, ldw, k, bias, y, ldy, n);
}

}  // namespace

int gemv_f32_max_batch() {
#if defined(__AVX512F__)
  return 8;
#else
  return 4;
#endif
}

void gemv_f32(const float* x, int64_t ldx, int batch, const float* w, int64_t ldw, int64_t k,
              const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  switch (batch) {
    case 1: return rows<1>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 2: return rows<2>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 3: return rows<3>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 4: return rows<4>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
#if defined(__AVX512F__)
    case 5: return rows<5>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 6: return rows<6>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 7: return rows<7>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
    case 8: return rows<8>(x, ldx, w, ldw, k, bias, y, ldy, n0, n1);
#endif
    default: break;  // the op checks the batch against gemv_f32_max_batch()
  }
}

}  // namespace kvmesh
