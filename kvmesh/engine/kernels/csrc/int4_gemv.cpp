// Small-batch products with INT4 weights in the layout of torch's CPU int4 kernel
// (_convert_weight_to_int4pack_for_cpu): blocks of `block` output rows (64 on AVX-512, 32 on
// AVX2) stored [K, block / 2] bytes, byte j of input k holding row j in its low nibble and row
// j + block / 2 in its high one; (scale, zero) per group and row in scales_zeros [K / group, N,
// 2], w = (q - 8) scale + zero. So the large-batch path (torch's kernel) and this one share one
// resident copy.
#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

inline Vec load_pair_value(const void* base, bool bf16, int64_t index, int part) {
  // 16 consecutive rows' scale (part 0) or zero (part 1) from [rows, 2] pairs
  if (bf16) return load_bf16_pairs(static_cast<const uint32_t*>(base) + index, part);
  return load_f32_pairs(static_cast<const float*>(base) + 2 * index, part);
}

// The rows of one block; each row's sum runs in the same order whatever kBatch. (Two 32-row
// blocks at once, for more independent sums, ran slower on the Zen 3 EPYC.)
template <int kBlock, int kBatch>
void block_rows(const Int4Gemv& g, int64_t block) {
  // Vec j holds rows 16 j.. 16 j + 15: the low nibbles of bytes 16 j.. for j < kPairs, the high
  // nibbles of bytes 16 (j - kPairs).. after
  constexpr int kHalf = kBlock / 2, kPairs = kHalf / 16, kVecs = 2 * kPairs;
  constexpr int kInputsPerLine = 64 / kHalf;
  const int64_t k = g.k, groups = k / g.group, row0 = block * kBlock;
  const uint8_t* w = g.packed + block * k * kHalf;
  Vec acc[kBatch][kVecs];
  for (int b = 0; b < kBatch; ++b)
    for (int j = 0; j < kVecs; ++j) acc[b][j] = zero();
  const int64_t pair_bytes = g.bf16 ? 4 : 8;
  const char* pairs = static_cast<const char*>(g.scales_zeros) + row0 * pair_bytes;
  for (int64_t gi = 0; gi < groups; ++gi) {
    // the block's (scale, zero) pairs two groups on: a strided read no hardware prefetcher sees
    if (gi + 2 < groups)
      for (int64_t at = 0; at < kBlock * pair_bytes; at += 64)
        _mm_prefetch(pairs + (gi + 2) * g.n * pair_bytes + at, _MM_HINT_T0);
    Vec part[kBatch][kVecs];
    for (int b = 0; b < kBatch; ++b)
      for (int j = 0; j < kVecs; ++j) part[b][j] = zero();
    for (int64_t kk = gi * g.group; kk < (gi + 1) * g.group; ++kk) {
      const uint8_t* bytes = w + kk * kHalf;
      // the next block's line at the same place (a line holds kInputsPerLine inputs' rows)
      if (kk % kInputsPerLine == 0)
        _mm_prefetch(reinterpret_cast<const char*>(bytes + k * kHalf), _MM_HINT_T0);
      Vec q[kVecs];
      for (int i = 0; i < kPairs; ++i) load_nibble_pair(bytes + 16 * i, q[i], q[kPairs + i]);
      for (int b = 0; b < kBatch; ++b) {
        const Vec xb = set1(g.x[b * k + kk]);
        for (int j = 0; j < kVecs; ++j) part[b][j] = fmadd(q[j], xb, part[b][j]);
      }
    }
    for (int j = 0; j < kVecs; ++j) {
      const int64_t row = row0 + 16 * j;
      const Vec scale = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 0);
      const Vec zero_point = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 1);
      for (int b = 0; b < kBatch; ++b) {
        const Vec sum = set1(g.group_sums[b * groups + gi]);
        // (q - 8) scale + zero, summed against x: scale (sum q x - 8 sum x) + zero sum x
        const Vec centred = fnmadd(set1(8.0f), sum, part[b][j]);
        acc[b][j] = fmadd(scale, centred, fmadd(zero_point, sum, acc[b][j]));
      }
    }
  }
  for (int b = 0; b < kBatch; ++b)
    for (int j = 0; j < kVecs; ++j) {
      const int64_t row = row0 + 16 * j;
      if (g.bf16) {
        alignas(64) float tmp[16];
        storeu(tmp, acc[b][j]);
        uint16_t* y = static_cast<uint16_t*>(g.y) + b * g.n + row;
        for (int r = 0; r < 16; ++r) y[r] = to_bf16(tmp[r]);
      } else {
        storeu(static_cast<float*>(g.y) + b * g.n + row, acc[b][j]);
      }
    }
}

template <int kBlock>
void blocks_of(const Int4Gemv& g, int64_t block0, int64_t block1) {
  for (int64_t block = block0; block < block1; ++block) {
    switch (g.batch) {
      case 1: block_rows<kBlock, 1>(g, block); break;
      case 2: block_rows<kBlock, 2>(g, block); break;
      case 3: block_rows<kBlock, 3>(g, block); break;
      default: block_rows<kBlock, 4>(g, block); break;
    }
  }
}

}  // namespace

void int4_gemv_blocks(const Int4Gemv& g, int64_t block0, int64_t block1) {
  if (g.block == 64) return blocks_of<64>(g, block0, block1);
  blocks_of<32>(g, block0, block1);
}

}  // namespace kvmesh
