// Small-batch bf16 matrix x vector products that stream the weights at memory speed: R weight
// rows at a time against every batch row, fp32 accumulators, one horizontal sum per output.
#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

constexpr int kAhead = 16;  // rows of prefetch distance (~18 KB for K = 576)

inline __mmask32 mask32(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << n) - 1); }

// acc += w . x over 32 bf16 lanes, with AVX512-BF16's dot product or by widening to fp32.
template <bool kDot>
inline __m512 dot32(__m512 acc, __m512i w, __m512i x);

template <>
__attribute__((target("avx512bf16"))) inline __m512 dot32<true>(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

template <>
inline __m512 dot32<false>(__m512 acc, __m512i w, __m512i x) {
  // odd lanes first, then even: the order AVX512-BF16 adds a pair in
  __m512 w_hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000)));
  __m512 x_hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000)));
  acc = _mm512_fmadd_ps(w_hi, x_hi, acc);
  __m512 w_lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  __m512 x_lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  return _mm512_fmadd_ps(w_lo, x_lo, acc);
}

template <int kRows, int kBatch, bool kDot>
__attribute__((target("avx512bf16"))) void block(const uint16_t* x, int64_t ldx,
                                                 const uint16_t* w, int64_t ldw, int64_t k,
                                                 const uint16_t* bias, uint16_t* y, int64_t ldy,
                                                 int64_t n) {
  __m512 acc[kRows][kBatch];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBatch; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    const __mmask32 m = mask32(k - i);
    __m512i xs[kBatch];
    for (int b = 0; b < kBatch; ++b) xs[b] = _mm512_maskz_loadu_epi16(m, x + b * ldx + i);
    for (int r = 0; r < kRows; ++r) {
      // the same line kAhead rows on: one core alone keeps too few misses in flight otherwise
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + kAhead) * ldw + i), _MM_HINT_T0);
      __m512i ws = _mm512_maskz_loadu_epi16(m, w + (n + r) * ldw + i);
      for (int b = 0; b < kBatch; ++b) acc[r][b] = dot32<kDot>(acc[r][b], ws, xs[b]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float add = 0.0f;
    if (bias) {
      uint32_t u = (uint32_t)bias[n + r] << 16;
      __builtin_memcpy(&add, &u, 4);
    }
    for (int b = 0; b < kBatch; ++b) y[b * ldy + n + r] = to_bf16(_mm512_reduce_add_ps(acc[r][b]) + add);
  }
}

template <int kBatch, bool kDot>
void rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k,
          const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int kRows = kBatch <= 4 ? 4 : 2;
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) block<kRows, kBatch, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n);
  for (; n < n1; ++n) block<1, kBatch, kDot>(x, ldx, w, ldw, k, bias, y, ldy, n);
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

// More than 8 batch rows: kGroupRows weight rows at a time (a few KB, so they stay in L1) against
// every group of 8 batch rows in turn. The weights still come from memory once; each output's
// sum is the one the 8-row kernel computes, whatever the batch.
template <bool kDot>
void grouped(const uint16_t* x, int64_t ldx, int batch, const uint16_t* w, int64_t ldw, int64_t k,
             const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t kGroupRows = 4;
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const int64_t end = std::min(n + kGroupRows, n1);
    for (int b = 0; b < batch; b += 8)
      dispatch<kDot>(x + b * ldx, ldx, std::min(8, batch - b), w, ldw, k, bias, y + b * ldy, ldy,
                     n, end);
  }
}

}  // namespace

bool cpu_has_bf16_dot() { return __builtin_cpu_supports("avx512bf16"); }

void gemv_bf16(const uint16_t* x, int64_t ldx, int batch, const uint16_t* w, int64_t ldw,
               int64_t k, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1,
               bool dot_bf16) {
  if (batch > 8)
    return dot_bf16 ? grouped<true>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1)
                    : grouped<false>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1);
  if (dot_bf16)
    dispatch<true>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1);
  else
    dispatch<false>(x, ldx, batch, w, ldw, k, bias, y, ldy, n0, n1);
}

}  // namespace kvmesh
