// Small-batch products with INT4 weights in the layout of torch's CPU int4 kernel
// (_convert_weight_to_int4pack_for_cpu on AVX-512): blocks of 64 output rows stored [K, 32]
// bytes, byte j of input k holding row j in its low nibble and row j + 32 in its high one;
// (scale, zero) per group and row in scales_zeros [K / group, N, 2], w = (q - 8) scale + zero.
// So the large-batch path (torch's kernel) and this one share one resident copy.
#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

constexpr int kBlock = 64;

inline __m512 load_pair_value(const void* base, bool bf16, int64_t index, int part) {
  // 16 consecutive rows' scale (part 0) or zero (part 1) from [rows, 2] pairs
  if (bf16) {
    const uint32_t* p = static_cast<const uint32_t*>(base) + index;  // one (scale, zero) pair
    __m512i pairs = _mm512_loadu_si512(p);
    __m512i v = part == 0 ? _mm512_slli_epi32(pairs, 16) : _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000));
    return _mm512_castsi512_ps(v);
  }
  const float* p = static_cast<const float*>(base) + 2 * index;
  __m512i idx = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  return _mm512_permutex2var_ps(_mm512_loadu_ps(p), _mm512_add_epi32(idx, _mm512_set1_epi32(part)),
                                _mm512_loadu_ps(p + 16));
}

template <int kBatch>
void block_rows(const Int4Gemv& g, int64_t block) {
  const int64_t k = g.k, groups = k / g.group;
  const uint8_t* w = g.packed + block * k * (kBlock / 2);
  __m512 acc[kBatch][4];
  for (int b = 0; b < kBatch; ++b)
    for (int i = 0; i < 4; ++i) acc[b][i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 part[kBatch][4];
    for (int b = 0; b < kBatch; ++b)
      for (int i = 0; i < 4; ++i) part[b][i] = _mm512_setzero_ps();
    for (int64_t kk = gi * g.group; kk < (gi + 1) * g.group; ++kk) {
      const uint8_t* bytes = w + kk * (kBlock / 2);
      // the next block's line at the same place (a line holds two inputs' 64 rows)
      if (!(kk & 1)) _mm_prefetch(reinterpret_cast<const char*>(bytes + k * (kBlock / 2)), _MM_HINT_T0);
      __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      const __m512i nibble = _mm512_set1_epi32(15);
      __m512 q[4] = {_mm512_cvtepi32_ps(_mm512_and_si512(lo, nibble)),   // rows 0..15
                     _mm512_cvtepi32_ps(_mm512_and_si512(hi, nibble)),   // rows 16..31
                     _mm512_cvtepi32_ps(_mm512_srli_epi32(lo, 4)),       // rows 32..47
                     _mm512_cvtepi32_ps(_mm512_srli_epi32(hi, 4))};      // rows 48..63
      for (int b = 0; b < kBatch; ++b) {
        const __m512 xb = _mm512_set1_ps(g.x[b * k + kk]);
        for (int i = 0; i < 4; ++i) part[b][i] = _mm512_fmadd_ps(q[i], xb, part[b][i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      const int64_t row = block * kBlock + 16 * i;
      const __m512 scale = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 0);
      const __m512 zero = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 1);
      for (int b = 0; b < kBatch; ++b) {
        const __m512 sum = _mm512_set1_ps(g.group_sums[b * groups + gi]);
        // (q - 8) scale + zero, summed against x: scale (sum q x - 8 sum x) + zero sum x
        const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sum, part[b][i]);
        acc[b][i] = _mm512_fmadd_ps(scale, centred, _mm512_fmadd_ps(zero, sum, acc[b][i]));
      }
    }
  }
  for (int b = 0; b < kBatch; ++b)
    for (int i = 0; i < 4; ++i) {
      const int64_t row = block * kBlock + 16 * i;
      if (g.bf16) {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, acc[b][i]);
        uint16_t* y = static_cast<uint16_t*>(g.y) + b * g.n + row;
        for (int r = 0; r < 16; ++r) y[r] = to_bf16(tmp[r]);
      } else {
        _mm512_storeu_ps(static_cast<float*>(g.y) + b * g.n + row, acc[b][i]);
      }
    }
}

}  // namespace

void int4_gemv_blocks(const Int4Gemv& g, int64_t block0, int64_t block1) {
  for (int64_t block = block0; block < block1; ++block) {
    switch (g.batch) {
      case 1: block_rows<1>(g, block); break;
      case 2: block_rows<2>(g, block); break;
      case 3: block_rows<3>(g, block); break;
      default: block_rows<4>(g, block); break;
    }
  }
}

}  // namespace kvmesh
