// Many horizontal sums at once, 16 side by side in the lanes of one result: transpose_sum16
// for attention scores, hsum16x16 for linear tiles (the same bits as vec.h's hsum, one sum at a
// time). The AVX2 build mirrors the AVX-512 shuffles on its two halves, the same trees.
#pragma once

#include "vec.h"

namespace kvmesh {

#if defined(__AVX512F__)

inline Vec pair_in_lanes(Vec a, Vec b) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
  return {_mm512_add_ps(_mm512_unpacklo_ps(a.v, b.v), _mm512_unpackhi_ps(a.v, b.v))};
}
inline Vec pairs_in_lanes(Vec a, Vec b) {  // per 128-bit lane: 64-bit halves of a, b added
  __m512d x = _mm512_castps_pd(a.v), y = _mm512_castps_pd(b.v);
  return {_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)))};
}
inline Vec odd_even_in_lanes(Vec a, Vec b) {  // per 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3]
  return {_mm512_add_ps(_mm512_shuffle_ps(a.v, b.v, 0x88), _mm512_shuffle_ps(a.v, b.v, 0xDD))};
}
inline Vec pair_chunks(Vec a, Vec b) {  // 128-bit chunks: [a0+a1, a2+a3, b0+b1, b2+b3]
  return {_mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x88), _mm512_shuffle_f32x4(a.v, b.v, 0xDD))};
}
inline Vec halves(Vec a, Vec b) {  // 128-bit chunks: [a0+a2, a1+a3, b0+b2, b1+b3]
  return {_mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x44), _mm512_shuffle_f32x4(a.v, b.v, 0xEE))};
}

#else

inline Vec pair_in_lanes(Vec a, Vec b) {
  return {_mm256_add_ps(_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.lo, b.lo)),
          _mm256_add_ps(_mm256_unpacklo_ps(a.hi, b.hi), _mm256_unpackhi_ps(a.hi, b.hi))};
}
inline __m256 pairs_in_lanes(__m256 a, __m256 b) {
  __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}
inline Vec pairs_in_lanes(Vec a, Vec b) { return {pairs_in_lanes(a.lo, b.lo), pairs_in_lanes(a.hi, b.hi)}; }
inline Vec odd_even_in_lanes(Vec a, Vec b) {
  return {_mm256_add_ps(_mm256_shuffle_ps(a.lo, b.lo, 0x88), _mm256_shuffle_ps(a.lo, b.lo, 0xDD)),
          _mm256_add_ps(_mm256_shuffle_ps(a.hi, b.hi, 0x88), _mm256_shuffle_ps(a.hi, b.hi, 0xDD))};
}
inline __m256 chunk_sums(Vec a) {  // [a0+a1, a2+a3] of a's 128-bit chunks
  return _mm256_add_ps(_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(a.lo, a.hi, 0x31));
}
inline Vec pair_chunks(Vec a, Vec b) { return {chunk_sums(a), chunk_sums(b)}; }
inline Vec halves(Vec a, Vec b) { return {_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi)}; }

#endif

// Lane j of the result = the sum of v[j]'s 16 lanes: pairs within 128-bit chunks, then chunks.
inline Vec transpose_sum16(const Vec* v) {
  Vec t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) t[i] = pair_in_lanes(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) u[i] = pairs_in_lanes(t[2 * i], t[2 * i + 1]);
  for (int i = 0; i < 2; ++i) w[i] = pair_chunks(u[2 * i], u[2 * i + 1]);
  return pair_chunks(w[0], w[1]);
}

// out[j] = hsum(v[j]), the same bits: the same tree, the 16 sums side by side in lanes
// (~2 instructions per sum instead of ~8).
inline void hsum16x16(const Vec* v, float* out) {
  Vec t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) t[i] = halves(v[2 * i], v[2 * i + 1]);  // i + (i + 8)
  for (int i = 0; i < 4; ++i) u[i] = pair_chunks(t[2 * i], t[2 * i + 1]);  // i + (i + 4)
  for (int i = 0; i < 2; ++i) w[i] = pairs_in_lanes(u[2 * i], u[2 * i + 1]);  // i + (i + 2)
  // lane 4q + j holds v[q + 4j]'s i + (i + 1)
  const Vec s = odd_even_in_lanes(w[0], w[1]);
  alignas(64) float lanes[16];
  storeu(lanes, s);
  for (int j = 0; j < 16; ++j) out[j] = lanes[(j % 4) * 4 + j / 4];
}

}  // namespace kvmesh
