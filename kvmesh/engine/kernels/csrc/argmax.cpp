// Row-wise argmax of logits (greedy sampling): the first index of the largest value, as
// torch.argmax returns it; a row holding NaN is reported (-1) for the caller's torch fallback.
#include <algorithm>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {

namespace {

// bf16 bits -> int16 keys in the order of their values, -0 and +0 the same key: a negative
// value's magnitude bits flipped, plus one. NaNs fall outside [key(-inf), key(+inf)].
inline __m256i bf16_keys(__m256i x) {
  const __m256i negative = _mm256_srai_epi16(x, 15);
  return _mm256_sub_epi16(_mm256_xor_si256(x, _mm256_and_si256(negative, _mm256_set1_epi16(0x7FFF))),
                          negative);
}
inline int16_t bf16_key(uint16_t x) {
  return (int16_t)(x & 0x8000 ? (x ^ 0x7FFF) + 1 : x);
}
constexpr int16_t kKeyPlusInf = 0x7F80, kKeyMinusInf = (int16_t)(0x807F + 1);

// One bf16 row: the largest key in a pass of 16-lane integer max / min (NaN checked by the
// extremes), then the first position holding it -- torch.argmax's answer; -1 for a NaN.
int64_t argmax_bf16(const uint16_t* p, int64_t width) {
  const int64_t whole = width / 16 * 16;
  __m256i high = _mm256_set1_epi16(kKeyMinusInf), low = _mm256_set1_epi16(kKeyPlusInf);
  for (int64_t c = 0; c < whole; c += 16) {
    const __m256i key = bf16_keys(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c)));
    high = _mm256_max_epi16(high, key), low = _mm256_min_epi16(low, key);
  }
  alignas(32) int16_t highs[16], lows[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(highs), high);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lows), low);
  int16_t top = kKeyMinusInf, bottom = kKeyPlusInf;
  for (int j = 0; j < 16; ++j) top = std::max(top, highs[j]), bottom = std::min(bottom, lows[j]);
  for (int64_t c = whole; c < width; ++c)
    top = std::max(top, bf16_key(p[c])), bottom = std::min(bottom, bf16_key(p[c]));
  if (top > kKeyPlusInf || bottom < kKeyMinusInf) return -1;
  const __m256i wanted = _mm256_set1_epi16(top);
  for (int64_t c = 0; c < whole; c += 16) {
    const __m256i key = bf16_keys(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c)));
    const uint32_t hits = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(key, wanted));
    if (hits) return c + __builtin_ctz(hits) / 2;
  }
  for (int64_t c = whole; c < width; ++c)
    if (bf16_key(p[c]) == top) return c;
  return 0;  // not reached: `top` is some element's key
}

}  // namespace

#if defined(__AVX512F__)
void argmax_rows(const void* logits, bool bf16, int64_t width, int64_t stride, int64_t* out,
                 int64_t row0, int64_t row1) {
  if (bf16) {
    for (int64_t row = row0; row < row1; ++row)
      out[row] = argmax_bf16(static_cast<const uint16_t*>(logits) + row * stride, width);
    return;
  }
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t row = row0; row < row1; ++row) {
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i at = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
    __mmask16 nan = 0;
    for (int64_t c = 0; c < width; c += 16) {
      const int n = (int)std::min<int64_t>(16, width - c);
      const __mmask16 valid = tail_mask(n);
      const __m512 v = load_f32(static_cast<const float*>(logits) + row * stride + c, n).v;
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

#else

void argmax_rows(const void* logits, bool bf16, int64_t width, int64_t stride, int64_t* out,
                 int64_t row0, int64_t row1) {
  if (bf16) {
    for (int64_t row = row0; row < row1; ++row)
      out[row] = argmax_bf16(static_cast<const uint16_t*>(logits) + row * stride, width);
    return;
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t row = row0; row < row1; ++row) {
    __m256 best[2] = {_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                      _mm256_set1_ps(-std::numeric_limits<float>::infinity())};
    __m256i at[2] = {_mm256_set1_epi32(std::numeric_limits<int32_t>::max()),
                     _mm256_set1_epi32(std::numeric_limits<int32_t>::max())};
    __m256 nan = _mm256_setzero_ps();
    for (int64_t c = 0; c < width; c += 16) {
      const int n = (int)std::min<int64_t>(16, width - c);
      const Vec v = load_f32(static_cast<const float*>(logits) + row * stride + c, n);
      const __m256 halves[2] = {v.lo, v.hi};
      for (int h = 0; h < 2; ++h) {
        const __m256 valid = lanes_below(n, 8 * h);
        nan = _mm256_or_ps(nan, _mm256_and_ps(valid, _mm256_cmp_ps(halves[h], halves[h], _CMP_UNORD_Q)));
        // strictly greater: each lane keeps the first index of its maximum
        const __m256 up = _mm256_and_ps(valid, _mm256_cmp_ps(halves[h], best[h], _CMP_GT_OQ));
        best[h] = _mm256_blendv_ps(best[h], halves[h], up);
        const __m256i index = _mm256_add_epi32(lanes, _mm256_set1_epi32((int)c + 8 * h));
        at[h] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[h]), _mm256_castsi256_ps(index), up));
      }
    }
    if (_mm256_movemask_ps(nan)) {
      out[row] = -1;
      continue;
    }
    const float top = hmax(Vec{best[0], best[1]});
    int32_t index = std::numeric_limits<int32_t>::max();  // a row of -inf only: torch answers 0
    alignas(32) float values[16];
    alignas(32) int32_t indices[16];
    _mm256_store_ps(values, best[0]), _mm256_store_ps(values + 8, best[1]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), at[0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices + 8), at[1]);
    for (int j = 0; j < 16; ++j)
      if (values[j] == top) index = std::min(index, indices[j]);
    out[row] = index == std::numeric_limits<int32_t>::max() ? 0 : index;
  }
}

#endif

}  // namespace kvmesh
