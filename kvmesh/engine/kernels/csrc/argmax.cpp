// Row-wise argmax of logits (greedy sampling): the first index of the largest value, as
// torch.argmax returns it; a row holding NaN is reported (-1) for the caller's torch fallback.
#include <algorithm>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {

void argmax_rows(const void* logits, bool bf16, int64_t width, int64_t stride, int64_t* out,
                 int64_t row0, int64_t row1) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t row = row0; row < row1; ++row) {
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i at = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
    __mmask16 nan = 0;
    for (int64_t c = 0; c < width; c += 16) {
      const int n = (int)std::min<int64_t>(16, width - c);
      const __mmask16 valid = tail_mask(n);
      __m512 v = bf16 ? load_bf16(static_cast<const uint16_t*>(logits) + row * stride + c, n)
                      : load_f32(static_cast<const float*>(logits) + row * stride + c, n);
      nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
      // strictly greater: each lane keeps the first index of its maximum
      const __mmask16 up = _mm512_mask_cmp_ps_mask(valid, v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, up, v);
      at = _mm512_mask_mov_epi32(at, up, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)c)));
    }
    if (nan) {
      out[row] = -1;
      continue;
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 hit = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    // a row of -inf only: every lane still holds INT_MAX; torch answers 0 there
    const int32_t index = _mm512_mask_reduce_min_epi32(hit, at);
    out[row] = index == std::numeric_limits<int32_t>::max() ? 0 : index;
  }
}

}  // namespace kvmesh
