// The pieces every bf16 linear kernel shares, so that each output's sum is the same bits
// whatever kernel or batch computes it: fp32 accumulators fed 32 k at a time by AVX512-BF16 dot
// products (or an exact emulation), then one horizontal sum in a fixed tree order.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvmesh {

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

// The sum of v's 16 lanes as a tree: lanes i + (i + 8), then i + (i + 4), i + (i + 2),
// i + (i + 1) (GCC's _mm512_reduce_add_ps order, written out so no compiler changes it).
inline float hsum16(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_extractf32x8_ps(v, 1), _mm512_castps512_ps256(v));
  __m128 b = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}

// hsum16 of 16 vectors at once: out[j] = hsum16(v[j]), the same bits (the same tree, the 16
// sums side by side in lanes: ~2 instructions per sum instead of ~8).
inline void hsum16x16(const __m512* v, float* out) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // halves: v[2i]'s i + (i + 8), then v[2i + 1]'s
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: v[4i + q]'s i + (i + 4)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {  // per quarter q: (v[8i + q], v[8i + 4 + q])'s i + (i + 2)
    __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lane 4q + j holds v[q + 4j]'s i + (i + 1)
  __m512 s = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  for (int j = 0; j < 16; ++j) out[j] = lanes[(j % 4) * 4 + j / 4];
}

}  // namespace kvmesh
