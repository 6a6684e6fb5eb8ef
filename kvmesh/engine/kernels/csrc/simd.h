// AVX-512 helpers shared by the kernels: loads that turn stored KV / weights into fp32 lanes,
// a vectorised exp, bf16 rounding. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq
// -mfma -mf16c; the Python loader only builds and loads this on CPUs that have them.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvmesh {

// Storage kinds of KV pages (kv/layout.py: fp32, bf16, fp8_e4m3 with power-of-two scales).
enum Storage : int { kF32 = 0, kBF16 = 1, kFP8 = 2 };

inline __mmask16 tail_mask(int n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

// Up to 16 values starting at p, as fp32 (lanes past n are zero).
inline __m512 load_f32(const float* p, int n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }

inline __m512 load_bf16(const uint16_t* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16(tail_mask(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e4m3fn bytes -> fp32 times 2**-8, exactly (the same bit move as kv_fp8.dequantize): the byte's
// sign, exponent and mantissa become an fp16's, whose conversion to fp32 is exact.
inline __m512 load_fp8(const int8_t* p, int n) {
  __m128i b = _mm_maskz_loadu_epi8(tail_mask(n), p);
  __m256i w = _mm256_cvtepi8_epi16(b);
  w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBFFF));
  return _mm512_cvtph_ps(w);
}

// exp(x) for x <= 0 (softmax arguments), ~1 ulp: 2**n * p(r), r = x - n ln2 in [-ln2/2, ln2/2].
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// fp32 -> bf16 with round-to-nearest-even (inputs are finite).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

}  // namespace kvmesh

namespace kvmesh {

// Lane j of the result = the sum of v[j]'s 16 lanes (16 horizontal sums in 4 shuffle levels).
inline __m512 transpose_sum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d] partial sums
    __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // lanes (0+1, 2+3) of u[2i], then of u[2i+1]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

}  // namespace kvmesh
