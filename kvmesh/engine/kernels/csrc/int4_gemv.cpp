// Small-batch products with INT4 weights in the layout of torch's CPU int4 kernel
// (_convert_weight_to_int4pack_for_cpu on AVX-512): blocks of 64 output rows stored [K, 32]
// bytes, byte j of input k holding row j in its low nibble and row j + 32 in its high one;
// (scale, zero) per group and row in scales_zeros [K / group, N, 2], w = (q - 8) scale + zero.
// So the large-batch path (torch's kernel) and this one share one resident copy. (On AVX2 torch
// packs 32-row blocks and its own kernel is the faster one: quant/int4.py uses it there.)
#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

inline Vec load_pair_value(const void* base, bool bf16, int64_t index, int part) {
  // 16 consecutive rows' scale (part 0) or zero (part 1) from [rows, 2] pairs
  if (bf16) return load_bf16_pairs(static_cast<const uint32_t*>(base) + index, part);
  return load_f32_pairs(static_cast<const float*>(base) + 2 * index, part);
}

constexpr int kBlock = 64, kChunks = kBlock / 16, kHalf = kBlock / 2;

template <int kBatch>
void block_rows(const Int4Gemv& g, int64_t block) {
  const int64_t k = g.k, groups = k / g.group;
  const uint8_t* w = g.packed + block * k * kHalf;
  Vec acc[kBatch][kChunks];
  for (int b = 0; b < kBatch; ++b)
    for (int i = 0; i < kChunks; ++i) acc[b][i] = zero();
  for (int64_t gi = 0; gi < groups; ++gi) {
    Vec part[kBatch][kChunks];
    for (int b = 0; b < kBatch; ++b)
      for (int i = 0; i < kChunks; ++i) part[b][i] = zero();
    for (int64_t kk = gi * g.group; kk < (gi + 1) * g.group; ++kk) {
      const uint8_t* bytes = w + kk * kHalf;
      // the next block's line at the same place (a line holds two inputs' 64 rows)
      if (!(kk & 1)) _mm_prefetch(reinterpret_cast<const char*>(bytes + k * kHalf), _MM_HINT_T0);
      Vec q[kChunks];  // rows 16 i.. 16 i + 15: low nibbles of the first half, then high ones
      for (int i = 0; i < kChunks; ++i) q[i] = load_nibbles(bytes + (16 * i) % kHalf, 16 * i >= kHalf);
      for (int b = 0; b < kBatch; ++b) {
        const Vec xb = set1(g.x[b * k + kk]);
        for (int i = 0; i < kChunks; ++i) part[b][i] = fmadd(q[i], xb, part[b][i]);
      }
    }
    for (int i = 0; i < kChunks; ++i) {
      const int64_t row = block * kBlock + 16 * i;
      const Vec scale = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 0);
      const Vec zero_point = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 1);
      for (int b = 0; b < kBatch; ++b) {
        const Vec sum = set1(g.group_sums[b * groups + gi]);
        // (q - 8) scale + zero, summed against x: scale (sum q x - 8 sum x) + zero sum x
        const Vec centred = fnmadd(set1(8.0f), sum, part[b][i]);
        acc[b][i] = fmadd(scale, centred, fmadd(zero_point, sum, acc[b][i]));
      }
    }
  }
  for (int b = 0; b < kBatch; ++b)
    for (int i = 0; i < kChunks; ++i) {
      const int64_t row = block * kBlock + 16 * i;
      if (g.bf16) {
        alignas(64) float tmp[16];
        storeu(tmp, acc[b][i]);
        uint16_t* y = static_cast<uint16_t*>(g.y) + b * g.n + row;
        for (int r = 0; r < 16; ++r) y[r] = to_bf16(tmp[r]);
      } else {
        storeu(static_cast<float*>(g.y) + b * g.n + row, acc[b][i]);
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
