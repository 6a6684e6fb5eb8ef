// RMSNorm as the HF models compute it, one row at a time: in fp32, then (for bf16) rounded to
// bf16 before the weight multiplies it; optionally after adding a residual in the input dtype.
#include <cmath>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

inline __m512 load_any(const void* p, bool bf16, int64_t i, int n) {
  return bf16 ? load_bf16(static_cast<const uint16_t*>(p) + i, n)
              : load_f32(static_cast<const float*>(p) + i, n);
}

inline __m512 round_bf16(__m512 v) {  // to the nearest bf16 (even on ties), kept in fp32 lanes
  __m512i u = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000)));
}

inline void store_any(void* p, bool bf16, int64_t i, int n, __m512 v) {
  const __mmask16 m = tail_mask(n);
  if (bf16) {
    __m512i u = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, _mm512_cvtepi32_epi16(u));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, v);
  }
}

}  // namespace

void rms_norm_rows(const NormRows& r, int64_t row0, int64_t row1) {
  const int d = (int)r.dim;
  for (int64_t row = row0; row < row1; ++row) {
    const int64_t at = row * r.dim;
    __m512 sq = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
      __m512 v = load_any(r.x, r.bf16, at + c, d - c);
      if (r.residual) {  // h = x + residual, rounded to the input dtype like torch's add
        v = _mm512_add_ps(v, load_any(r.residual, r.bf16, at + c, d - c));
        if (r.bf16) v = round_bf16(v);
        store_any(r.sum_out, r.bf16, at + c, d - c, v);
      }
      sq = _mm512_fmadd_ps(v, v, sq);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / (float)d + r.eps);
    const void* src = r.residual ? r.sum_out : r.x;
    for (int c = 0; c < d; c += 16) {
      __m512 v = _mm512_mul_ps(load_any(src, r.bf16, at + c, d - c), _mm512_set1_ps(inv));
      if (r.bf16) v = round_bf16(v);
      v = _mm512_mul_ps(v, load_any(r.weight, r.bf16, c, d - c));
      store_any(r.out, r.bf16, at + c, d - c, v);
    }
  }
}

}  // namespace kvmesh
