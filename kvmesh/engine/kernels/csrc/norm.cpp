// RMSNorm as the HF models compute it, one row at a time: in fp32, then (for bf16) rounded to
// bf16 before the weight multiplies it; optionally after adding a residual in the input dtype.
#include <cmath>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

inline Vec load_any(const void* p, bool bf16, int64_t i, int n) {
  return bf16 ? load_bf16(static_cast<const uint16_t*>(p) + i, n)
              : load_f32(static_cast<const float*>(p) + i, n);
}

inline void store_any(void* p, bool bf16, int64_t i, int n, Vec v) {
  if (bf16)
    store_bf16_high(static_cast<uint16_t*>(p) + i, n, round_bf16(v));
  else
    store_f32(static_cast<float*>(p) + i, n, v);
}

}  // namespace

void rms_norm_rows(const NormRows& r, int64_t row0, int64_t row1) {
  const int d = (int)r.dim;
  for (int64_t row = row0; row < row1; ++row) {
    const int64_t at = row * r.dim;
    Vec sq = zero();
    for (int c = 0; c < d; c += 16) {
      Vec v = load_any(r.x, r.bf16, at + c, d - c);
      if (r.residual) {  // h = x + residual, rounded to the input dtype like torch's add
        v = add(v, load_any(r.residual, r.bf16, at + c, d - c));
        if (r.bf16) v = round_bf16(v);
        store_any(r.sum_out, r.bf16, at + c, d - c, v);
      }
      sq = fmadd(v, v, sq);
    }
    const float inv = 1.0f / std::sqrt(hsum(sq) / (float)d + r.eps);
    const void* src = r.residual ? r.sum_out : r.x;
    for (int c = 0; c < d; c += 16) {
      Vec v = mul(load_any(src, r.bf16, at + c, d - c), set1(inv));
      if (r.bf16) v = round_bf16(v);
      v = mul(v, load_any(r.weight, r.bf16, c, d - c));
      store_any(r.out, r.bf16, at + c, d - c, v);
    }
  }
}

}  // namespace kvmesh
