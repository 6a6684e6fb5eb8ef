// Rotary embedding of q and k in place, the same bits as models/rope.apply_rotary:
// x * cos + rotate_half(x) * sin with each product and the sum rounded to the dtype, as torch's
// element-wise ops do (no fused multiply-add: the file builds with -ffp-contract=off).
#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

inline __m512 rounded(__m512 v, bool bf16) {
  if (!bf16) return v;
  __m512i u = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000)));
}

inline __m512 load(const void* p, bool bf16, int64_t i, int n) {
  return bf16 ? load_bf16(static_cast<const uint16_t*>(p) + i, n)
              : load_f32(static_cast<const float*>(p) + i, n);
}

inline void store(void* p, bool bf16, int64_t i, int n, __m512 v) {
  if (bf16) {
    __m512i u = _mm512_srli_epi32(_mm512_castps_si512(v), 16);  // already rounded
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, tail_mask(n), _mm512_cvtepi32_epi16(u));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, tail_mask(n), v);
  }
}

}  // namespace

void rope_rows(const RopeRows& r, int64_t row0, int64_t row1) {
  const int half = (int)(r.dim / 2);
  for (int64_t t = row0; t < row1; ++t) {
    for (int h = 0; h < r.heads; ++h) {
      const int64_t at = t * r.row_stride + h * r.head_stride;
      for (int c = 0; c < half; c += 16) {
        const int n = std::min(16, half - c);
        const __m512 lo = load(r.x, r.bf16, at + c, n), hi = load(r.x, r.bf16, at + half + c, n);
        const __m512 cos_lo = load(r.cos, r.bf16, t * r.dim + c, n);
        const __m512 cos_hi = load(r.cos, r.bf16, t * r.dim + half + c, n);
        const __m512 sin_lo = load(r.sin, r.bf16, t * r.dim + c, n);
        const __m512 sin_hi = load(r.sin, r.bf16, t * r.dim + half + c, n);
        // first half: x_lo cos_lo + (-x_hi) sin_lo; second: x_hi cos_hi + x_lo sin_hi
        const __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
        const __m512 a = _mm512_add_ps(rounded(_mm512_mul_ps(lo, cos_lo), r.bf16),
                                       rounded(_mm512_mul_ps(neg_hi, sin_lo), r.bf16));
        const __m512 b = _mm512_add_ps(rounded(_mm512_mul_ps(hi, cos_hi), r.bf16),
                                       rounded(_mm512_mul_ps(lo, sin_hi), r.bf16));
        store(r.out, r.bf16, t * r.out_row + h * r.dim + c, n, rounded(a, r.bf16));
        store(r.out, r.bf16, t * r.out_row + h * r.dim + half + c, n, rounded(b, r.bf16));
      }
    }
  }
}

}  // namespace kvmesh
