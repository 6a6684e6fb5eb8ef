// Vec: 16 fp32 lanes, the unit every kernel computes in. One zmm register where the kernels
// are built for AVX-512; a pair of ymm registers (lanes 0-7, 8-15) where they are built for
// AVX2 + FMA + F16C (build.py picks the build from the CPU). Bf32: 32 bf16 lanes the same way.
// Each operation is one IEEE operation per lane, and the horizontal sums follow one written-out
// tree in both builds, so a kernel computes the same sums in the same order in either.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace kvmesh {

#if defined(__AVX512F__)

struct Vec {
  __m512 v;
};
struct Bf32 {
  __m512i v;
};

inline __mmask16 tail_mask(int n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
inline __mmask32 mask32(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << n) - 1); }

inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float f) { return {_mm512_set1_ps(f)}; }
inline Vec set1_bits(uint32_t u) { return {_mm512_castsi512_ps(_mm512_set1_epi32((int)u))}; }
inline Vec loadu(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void storeu(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a b + c
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a b
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec round_int(Vec a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline Vec scale2(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a 2**n, n integral
inline Vec first(int n, Vec a, float fill) {  // lanes from n on replaced by fill
  return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), tail_mask(n), a.v)};
}
inline Vec bits_and(Vec a, uint32_t m) {
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32((int)m)))};
}
inline Vec bits_add(Vec a, Vec b) {  // lane-wise integer sum of the bit patterns
  return {_mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a.v), _mm512_castps_si512(b.v)))};
}
inline Vec bits_shr16(Vec a) { return {_mm512_castsi512_ps(_mm512_srli_epi32(_mm512_castps_si512(a.v), 16))}; }

// Up to 16 values from p as fp32 (lanes past n are zero).
inline Vec load_f32(const float* p, int n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
inline Vec load_bf16(const uint16_t* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16(tail_mask(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// e4m3fn bytes -> fp32 times 2**-8, exactly (the same bit move as kv_fp8.dequantize): the byte's
// sign, exponent and mantissa become an fp16's, whose conversion to fp32 is exact.
inline Vec load_fp8(const int8_t* p, int n) {
  __m128i b = _mm_maskz_loadu_epi8(tail_mask(n), p);
  __m256i w = _mm256_cvtepi8_epi16(b);
  w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBFFF));
  return {_mm512_cvtph_ps(w)};
}
// 32 of them (lanes past n zero) as lanes 0-15 and 16-31: the same bit move, widened, shifted
// and masked once for both halves.
inline void load_fp8_pair(const int8_t* p, int n, Vec& lo, Vec& hi) {
  __m256i b = _mm256_maskz_loadu_epi8(mask32(n), p);
  __m512i w = _mm512_cvtepi8_epi16(b);
  w = _mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16((short)0xBFFF));
  lo = {_mm512_cvtph_ps(_mm512_castsi512_si256(w))};
  hi = {_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1))};
}
// 16 bytes as fp32 lanes: their low nibbles, and their high ones.
inline void load_nibble_pair(const uint8_t* p, Vec& low, Vec& high) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
  high = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
}
// 16 consecutive pairs of bf16 (scale, zero): part 0 the first of each pair, 1 the second.
inline Vec load_bf16_pairs(const uint32_t* p, int part) {
  __m512i pairs = _mm512_loadu_si512(p);
  __m512i v = part == 0 ? _mm512_slli_epi32(pairs, 16) : _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000));
  return {_mm512_castsi512_ps(v)};
}
// ... and of 16 consecutive pairs of fp32.
inline Vec load_f32_pairs(const float* p, int part) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  return {_mm512_permutex2var_ps(_mm512_loadu_ps(p), _mm512_add_epi32(even, _mm512_set1_epi32(part)),
                                 _mm512_loadu_ps(p + 16))};
}
inline void store_f32(float* p, int n, Vec a) { _mm512_mask_storeu_ps(p, tail_mask(n), a.v); }
// The high 16 bits of each lane (a bf16 already rounded into an fp32 lane), up to n of them.
inline void store_bf16_high(uint16_t* p, int n, Vec a) {
  __m512i u = _mm512_srli_epi32(_mm512_castps_si512(a.v), 16);
  _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtepi32_epi16(u));
}

inline float hmax(Vec a) { return _mm512_reduce_max_ps(a.v); }

// The sum of a's 16 lanes as a tree: lanes i + (i + 8), then i + (i + 4), i + (i + 2),
// i + (i + 1) (GCC's _mm512_reduce_add_ps order, written out so no compiler changes it).
inline float hsum(Vec a) {
  __m256 s = _mm256_add_ps(_mm512_extractf32x8_ps(a.v, 1), _mm512_castps512_ps256(a.v));
  __m128 b = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
  __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}

// 32 bf16 values from p (lanes past n zero).
inline Bf32 load_bf32(const uint16_t* p, int64_t n) { return {_mm512_maskz_loadu_epi16(mask32(n), p)}; }
// fp32 lanes of the odd (high halves of each 32-bit lane) or even bf16 values of w.
inline Vec bf16_odd(Bf32 w) { return {_mm512_castsi512_ps(_mm512_and_si512(w.v, _mm512_set1_epi32((int)0xFFFF0000)))}; }
inline Vec bf16_even(Bf32 w) { return {_mm512_castsi512_ps(_mm512_slli_epi32(w.v, 16))}; }

#else  // AVX2: lanes 0-7 in lo, 8-15 in hi

struct Vec {
  __m256 lo, hi;
};
struct Bf32 {
  __m256i lo, hi;  // values 0-15, 16-31
};

inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline Vec set1_bits(uint32_t u) {
  const __m256 b = _mm256_castsi256_ps(_mm256_set1_epi32((int)u));
  return {b, b};
}
inline Vec loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu(float* p, Vec a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec fnmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec round_int(Vec a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2(__m256 n) {  // 2**n for integral n in [-126, 127], exactly
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec scale2(Vec a, Vec n) {  // a 2**n: one rounding, as scalef (n >= -126 here)
  return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))};
}
inline __m256 lanes_below(int n, int from) {  // all-ones lanes where from + lane < n
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - from), lane));
}
inline Vec first(int n, Vec a, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, lanes_below(n, 0)), _mm256_blendv_ps(f, a.hi, lanes_below(n, 8))};
}
inline __m256i as_int(__m256 a) { return _mm256_castps_si256(a); }
inline __m256 as_float(__m256i a) { return _mm256_castsi256_ps(a); }
inline Vec bits_and(Vec a, uint32_t m) {
  const __m256i k = _mm256_set1_epi32((int)m);
  return {as_float(_mm256_and_si256(as_int(a.lo), k)), as_float(_mm256_and_si256(as_int(a.hi), k))};
}
inline Vec bits_add(Vec a, Vec b) {
  return {as_float(_mm256_add_epi32(as_int(a.lo), as_int(b.lo))),
          as_float(_mm256_add_epi32(as_int(a.hi), as_int(b.hi)))};
}
inline Vec bits_shr16(Vec a) {
  return {as_float(_mm256_srli_epi32(as_int(a.lo), 16)), as_float(_mm256_srli_epi32(as_int(a.hi), 16))};
}

// Short tails without a call (a memcpy in a kernel's inner loop would make the compiler keep
// every accumulator in memory) and without reading past the last element: whole 32-bit words
// by masked load, then the odd 16-bit or 8-bit elements one by one, other lanes zero.
inline __m256i dwords_below(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256i load_words(const uint16_t* p, int n) {  // n in [0, 16]
  __m256i v = _mm256_maskload_epi32(reinterpret_cast<const int*>(p), dwords_below(n / 2));
  if (n & 1) {
    const __m256i at = _mm256_cmpeq_epi16(_mm256_set1_epi16((short)(n - 1)),
                                          _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    v = _mm256_blendv_epi8(v, _mm256_set1_epi16((short)p[n - 1]), at);
  }
  return v;
}
inline __m128i load_bytes(const int8_t* p, int n) {  // n in [0, 16]
  __m128i v = _mm_maskload_epi32(reinterpret_cast<const int*>(p), _mm256_castsi256_si128(dwords_below(n / 4)));
  const __m128i lane = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int j = n & ~3; j < n; ++j)
    v = _mm_blendv_epi8(v, _mm_set1_epi8(p[j]), _mm_cmpeq_epi8(_mm_set1_epi8((char)j), lane));
  return v;
}

inline Vec load_f32(const float* p, int n) {
  if (n >= 16) return loadu(p);
  return {_mm256_maskload_ps(p, as_int(lanes_below(n, 0))), _mm256_maskload_ps(p + 8, as_int(lanes_below(n, 8)))};
}
inline Vec widen_bf16(__m256i h) {  // 16 bf16 -> 16 fp32
  return {as_float(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16)),
          as_float(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16))};
}
inline Vec load_bf16(const uint16_t* p, int n) {
  if (n < 16) return widen_bf16(load_words(p, n < 0 ? 0 : n));
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// e4m3fn bytes -> fp32 times 2**-8, exactly (see the AVX-512 version).
inline Vec load_fp8(const int8_t* p, int n) {
  __m128i b = n < 16 ? load_bytes(p, n < 0 ? 0 : n) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i w = _mm256_cvtepi8_epi16(b);
  w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBFFF));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(w)), _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1))};
}
inline void load_fp8_pair(const int8_t* p, int n, Vec& lo, Vec& hi) {
  lo = load_fp8(p, std::min(n, 16));
  hi = load_fp8(p + 16, n - 16);
}
inline void load_nibble_pair(const uint8_t* p, Vec& low, Vec& high) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i m = _mm256_set1_epi32(15);
  low = {_mm256_cvtepi32_ps(_mm256_and_si256(lo, m)), _mm256_cvtepi32_ps(_mm256_and_si256(hi, m))};
  high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4))};
}
inline Vec load_bf16_pairs(const uint32_t* p, int part) {
  Vec pairs = loadu(reinterpret_cast<const float*>(p));
  return part == 0 ? Vec{as_float(_mm256_slli_epi32(as_int(pairs.lo), 16)), as_float(_mm256_slli_epi32(as_int(pairs.hi), 16))}
                   : bits_and(pairs, 0xFFFF0000u);
}
inline Vec load_f32_pairs(const float* p, int part) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i at = _mm256_add_epi32(even, _mm256_set1_epi32(part));
  return {_mm256_i32gather_ps(p, at, 4), _mm256_i32gather_ps(p + 16, at, 4)};
}
inline void store_f32(float* p, int n, Vec a) {
  if (n >= 16) return storeu(p, a);
  _mm256_maskstore_ps(p, as_int(lanes_below(n, 0)), a.lo);
  _mm256_maskstore_ps(p + 8, as_int(lanes_below(n, 8)), a.hi);
}
inline void store_bf16_high(uint16_t* p, int n, Vec a) {
  Vec u = bits_shr16(a);  // each lane < 2**16: packs without saturating
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(as_int(u.lo), as_int(u.hi)), 0xD8);
  if (n >= 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  alignas(32) uint16_t tmp[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), packed);
  for (int j = 0; j < n; ++j) p[j] = tmp[j];
}

inline float hmax(Vec a) {
  __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 b = _mm_max_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
  b = _mm_max_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(b), _mm_cvtss_f32(_mm_shuffle_ps(b, b, 1)));
}

// The same tree as the AVX-512 build's: i + (i + 8) is lo + hi.
inline float hsum(Vec a) {
  __m256 s = _mm256_add_ps(a.hi, a.lo);
  __m128 b = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
  __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}

inline Bf32 load_bf32(const uint16_t* p, int64_t n) {
  if (n < 32) {
    const int m = n < 0 ? 0 : (int)n;
    return {load_words(p, m < 16 ? m : 16), load_words(p + 16, m < 16 ? 0 : m - 16)};
  }
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
inline Vec bf16_odd(Bf32 w) {
  const __m256i m = _mm256_set1_epi32((int)0xFFFF0000);
  return {as_float(_mm256_and_si256(w.lo, m)), as_float(_mm256_and_si256(w.hi, m))};
}
inline Vec bf16_even(Bf32 w) { return {as_float(_mm256_slli_epi32(w.lo, 16)), as_float(_mm256_slli_epi32(w.hi, 16))}; }

#endif

// exp(x) for x <= 0 (softmax arguments), ~1 ulp: 2**n * p(r), r = x - n ln2 in [-ln2/2, ln2/2].
inline Vec exp_neg(Vec x) {
  x = max(x, set1(-87.0f));
  const Vec n = round_int(mul(x, set1(1.44269504088896341f)));
  Vec r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  Vec p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return scale2(p, n);
}

// Each lane rounded to the nearest bf16 (even on ties), kept as fp32 (finite inputs).
inline Vec round_bf16(Vec a) {
  const Vec odd = bits_and(bits_shr16(a), 1);
  return bits_and(bits_add(a, bits_add(set1_bits(0x7FFF), odd)), 0xFFFF0000u);
}

}  // namespace kvmesh
