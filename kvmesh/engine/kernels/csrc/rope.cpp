// Rotary embedding of q and k in place, the same bits as models/rope.apply_rotary:
// x * cos + rotate_half(x) * sin with each product and the sum rounded to the dtype, as torch's
// element-wise ops do (no fused multiply-add: the file builds with -ffp-contract=off).
#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

inline Vec rounded(Vec v, bool bf16) { return bf16 ? round_bf16(v) : v; }

inline Vec load(const void* p, bool bf16, int64_t i, int n) {
  return bf16 ? load_bf16(static_cast<const uint16_t*>(p) + i, n)
              : load_f32(static_cast<const float*>(p) + i, n);
}

inline void store(void* p, bool bf16, int64_t i, int n, Vec v) {
  if (bf16)
    store_bf16_high(static_cast<uint16_t*>(p) + i, n, v);  // already rounded
  else
    store_f32(static_cast<float*>(p) + i, n, v);
}

}  // namespace

void rope_rows(const RopeRows& r, int64_t row0, int64_t row1) {
  const int half = (int)(r.dim / 2);
  for (int64_t t = row0; t < row1; ++t) {
    for (int h = 0; h < r.heads; ++h) {
      const int64_t at = t * r.row_stride + h * r.head_stride;
      for (int c = 0; c < half; c += 16) {
        const int n = std::min(16, half - c);
        const Vec lo = load(r.x, r.bf16, at + c, n), hi = load(r.x, r.bf16, at + half + c, n);
        const Vec cos_lo = load(r.cos, r.bf16, t * r.dim + c, n);
        const Vec cos_hi = load(r.cos, r.bf16, t * r.dim + half + c, n);
        const Vec sin_lo = load(r.sin, r.bf16, t * r.dim + c, n);
        const Vec sin_hi = load(r.sin, r.bf16, t * r.dim + half + c, n);
        // first half: x_lo cos_lo + (-x_hi) sin_lo; second: x_hi cos_hi + x_lo sin_hi
        const Vec neg_hi = sub(zero(), hi);
        const Vec a = add(rounded(mul(lo, cos_lo), r.bf16), rounded(mul(neg_hi, sin_lo), r.bf16));
        const Vec b = add(rounded(mul(hi, cos_hi), r.bf16), rounded(mul(lo, sin_hi), r.bf16));
        store(r.out, r.bf16, t * r.out_row + h * r.dim + c, n, rounded(a, r.bf16));
        store(r.out, r.bf16, t * r.out_row + h * r.dim + half + c, n, rounded(b, r.bf16));
      }
    }
  }
}

}  // namespace kvmesh
