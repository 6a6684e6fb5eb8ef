// Small-batch products with INT4 weights in the layout of torch's CPU int4 kernel
// (_convert_weight_to_int4pack_for_cpu): blocks of `block` output rows (64 on AVX-512, 32 on
// AVX2) stored [K, block / 2] bytes, byte j of input k holding row j in its low nibble and row
// j + block / 2 in its high one; (scale, zero) per group and row in scales_zeros [K / group, N,
// 2], w = (q - 8) scale + zero. So the large-batch path (torch's kernel) and this one share one
// resident copy. Every loop over accumulators is unrolled (`#pragma GCC unroll`): an index the
// compiler cannot resolve keeps them in memory, stored on every step (as gemv.cpp).
#include <algorithm>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

inline Vec load_pair_value(const void* base, bool bf16, int64_t index, int part) {
  // 16 consecutive rows' scale (part 0) or zero (part 1) from [rows, 2] pairs
  if (bf16) return load_bf16_pairs(static_cast<const uint32_t*>(base) + index, part);
  return load_f32_pairs(static_cast<const float*>(base) + 2 * index, part);
}

// The (scale, zero) pairs of `rows` rows from row0, two groups after gi: a strided read no
// hardware prefetcher sees.
inline void prefetch_scales(const Int4Gemv& g, int64_t row0, int rows, int64_t gi) {
  const int64_t pair_bytes = g.bf16 ? 4 : 8;
  if (gi + 2 >= g.k / g.group) return;
  const char* at = static_cast<const char*>(g.scales_zeros) + ((gi + 2) * g.n + row0) * pair_bytes;
  for (int64_t off = 0; off < rows * pair_bytes; off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
}

// acc += group gi's share: (q - 8) scale + zero summed against x is scale (sum q x - 8 sum x) +
// zero sum x, where part holds sum (q + bias) x and sums the group sums of x.
template <int kBatch, int kVecs>
inline void add_group(const Int4Gemv& g, const float* sums, float bias, int64_t gi, int64_t row0,
                      Vec (&part)[kBatch][kVecs], Vec (&acc)[kBatch][kVecs]) {
  const int64_t groups = g.k / g.group;
#pragma GCC unroll 16
  for (int j = 0; j < kVecs; ++j) {
    const int64_t row = row0 + 16 * j;
    const Vec scale = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 0);
    const Vec zero_point = load_pair_value(g.scales_zeros, g.bf16, gi * g.n + row, 1);
#pragma GCC unroll 16
    for (int b = 0; b < kBatch; ++b) {
      const Vec sum = set1(sums[b * groups + gi]);
      const Vec centred = fnmadd(set1(8.0f + bias), sum, part[b][j]);
      acc[b][j] = fmadd(scale, centred, fmadd(zero_point, sum, acc[b][j]));
    }
  }
}

// y rows row0.. of every batch row, in y's dtype.
template <int kBatch, int kVecs>
inline void store_rows(const Int4Gemv& g, int64_t row0, Vec (&acc)[kBatch][kVecs]) {
#pragma GCC unroll 16
  for (int b = 0; b < kBatch; ++b)
#pragma GCC unroll 16
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
#pragma GCC unroll 16
  for (int b = 0; b < kBatch; ++b)
#pragma GCC unroll 16
    for (int j = 0; j < kVecs; ++j) acc[b][j] = zero();
  for (int64_t gi = 0; gi < groups; ++gi) {
    prefetch_scales(g, row0, kBlock, gi);
    Vec part[kBatch][kVecs];
#pragma GCC unroll 16
    for (int b = 0; b < kBatch; ++b)
#pragma GCC unroll 16
      for (int j = 0; j < kVecs; ++j) part[b][j] = zero();
    for (int64_t kk = gi * g.group; kk < (gi + 1) * g.group; ++kk) {
      const uint8_t* bytes = w + kk * kHalf;
      // the next block's line at the same place (a line holds kInputsPerLine inputs' rows)
      if (kk % kInputsPerLine == 0)
        _mm_prefetch(reinterpret_cast<const char*>(bytes + k * kHalf), _MM_HINT_T0);
      Vec q[kVecs];
#pragma GCC unroll 16
      for (int i = 0; i < kPairs; ++i) load_nibble_pair(bytes + 16 * i, q[i], q[kPairs + i]);
#pragma GCC unroll 16
      for (int b = 0; b < kBatch; ++b) {
        const Vec xb = set1(g.x[b * k + kk]);
#pragma GCC unroll 16
        for (int j = 0; j < kVecs; ++j) part[b][j] = fmadd(q[j], xb, part[b][j]);
      }
    }
    add_group(g, g.group_sums, 0.0f, gi, row0, part, acc);
  }
  store_rows(g, row0, acc);
}

// Batch rows b0.. (at most 4) of g: more than 4 rows go through a block 4 at a time, its bytes
// read from memory by the first 4 and from cache by the rest (each row's sum as alone).
inline Int4Gemv batch_slice(const Int4Gemv& g, int b0) {
  Int4Gemv part = g;
  part.batch = std::min(4, g.batch - b0);
  if (g.x) part.x = g.x + b0 * g.k;
  if (g.group_sums) part.group_sums = g.group_sums + b0 * (g.k / g.group);
  if (g.x_bf16) part.x_bf16 = g.x_bf16 + b0 * g.k;
  part.y = static_cast<char*>(g.y) + (g.bf16 ? 2 : 4) * b0 * g.n;
  return part;
}

template <int kBlock>
void blocks_of(const Int4Gemv& g, int64_t block0, int64_t block1) {
  for (int64_t block = block0; block < block1; ++block)
    for (int b0 = 0; b0 < g.batch; b0 += 4) {
      const Int4Gemv part = batch_slice(g, b0);
      switch (part.batch) {
        case 1: block_rows<kBlock, 1>(part, block); break;
        case 2: block_rows<kBlock, 2>(part, block); break;
        case 3: block_rows<kBlock, 3>(part, block); break;
        default: block_rows<kBlock, 4>(part, block); break;
      }
    }
}

#if defined(__AVX512F__)
// bf16 x on AVX512-BF16 + VBMI: the 64 bytes of inputs kk and kk + 1 of a 64-row block are one
// load, and one byte permute per 16 rows makes each row's (q[kk], q[kk + 1]) a bf16 pair for a
// dot product: the byte q under a high byte 0x43 is the bf16 128 + q, exactly. So the group's
// sum is sum (128 + q) x = sum q x + 128 sum x, and the group adds scale (that - 136 sum x) +
// zero sum x. Three vector instructions per 32 weights where widening nibbles to fp32 took eight,
// and x is read as it is (no fp32 copy, no group sums by torch per call).
#define KVMESH_INT4_DOT_TARGET __attribute__((target("avx512bf16,avx512vbmi")))

// Byte permute indices: dword j of the rows 16 half + j is (row byte of kk, 0x43, row byte of
// kk + 1, 0x43), the row bytes from the nibbles (a), the 0x43s from a constant (b, bit 6 set).
KVMESH_INT4_DOT_TARGET inline __m512i pair_index(int half) {
  alignas(64) uint8_t at[64];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    at[4 * j] = (uint8_t)(16 * half + j);
    at[4 * j + 1] = 64;
    at[4 * j + 2] = (uint8_t)(32 + 16 * half + j);
    at[4 * j + 3] = 64;
  }
  return _mm512_load_si512(at);
}

template <int kBatch>
KVMESH_INT4_DOT_TARGET void block_rows_dot(const Int4Gemv& g, const float* sums, int64_t block) {
  const int64_t k = g.k, groups = k / g.group, row0 = block * 64;
  const uint8_t* w = g.packed + block * k * 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x43);
  const __m512i at0 = pair_index(0), at1 = pair_index(1);
  Vec acc[kBatch][4];
#pragma GCC unroll 16
  for (int b = 0; b < kBatch; ++b)
#pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) acc[b][j] = zero();
  for (int64_t gi = 0; gi < groups; ++gi) {
    prefetch_scales(g, row0, 64, gi);
    Vec part[kBatch][4];
#pragma GCC unroll 16
    for (int b = 0; b < kBatch; ++b)
#pragma GCC unroll 16
      for (int j = 0; j < 4; ++j) part[b][j] = zero();
    for (int64_t kk = gi * g.group; kk < (gi + 1) * g.group; kk += 2) {
      const uint8_t* bytes = w + kk * 32;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + k * 32), _MM_HINT_T0);  // next block
      const __m512i v = _mm512_loadu_si512(bytes);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      const __m512bh q[4] = {(__m512bh)_mm512_permutex2var_epi8(lo, at0, high),
                             (__m512bh)_mm512_permutex2var_epi8(lo, at1, high),
                             (__m512bh)_mm512_permutex2var_epi8(hi, at0, high),
                             (__m512bh)_mm512_permutex2var_epi8(hi, at1, high)};
#pragma GCC unroll 16
      for (int b = 0; b < kBatch; ++b) {
        uint32_t xs;
        __builtin_memcpy(&xs, g.x_bf16 + b * k + kk, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xs);
#pragma GCC unroll 16
        for (int j = 0; j < 4; ++j) part[b][j] = {_mm512_dpbf16_ps(part[b][j].v, q[j], xb)};
      }
    }
    add_group(g, sums, 128.0f, gi, row0, part, acc);  // the bf16 weights are 128 + q
  }
  store_rows(g, row0, acc);
}

void blocks_dot(const Int4Gemv& g, int64_t block0, int64_t block1) {
  // each x row's sum per group: the caller's, or this call's own (a few hundred adds a row)
  const int64_t groups = g.k / g.group;
  std::vector<float> own;
  if (!g.group_sums) {
    own.resize(g.batch * groups);
    int4_group_sums_bf16(g.x_bf16, g.batch, g.k, g.group, own.data());
  }
  const float* sums = g.group_sums ? g.group_sums : own.data();
  for (int64_t block = block0; block < block1; ++block)
    for (int b0 = 0; b0 < g.batch; b0 += 4) {
      const Int4Gemv part = batch_slice(g, b0);
      const float* part_sums = sums + b0 * groups;
      switch (part.batch) {
        case 1: block_rows_dot<1>(part, part_sums, block); break;
        case 2: block_rows_dot<2>(part, part_sums, block); break;
        case 3: block_rows_dot<3>(part, part_sums, block); break;
        default: block_rows_dot<4>(part, part_sums, block); break;
      }
    }
}
#endif

}  // namespace

void int4_group_sums_bf16(const uint16_t* x, int batch, int64_t k, int64_t group, float* sums) {
  const int64_t groups = k / group;
  for (int b = 0; b < batch; ++b)
    for (int64_t gi = 0; gi < groups; ++gi) {
      float s = 0.0f;  // in k order
      for (int64_t kk = gi * group; kk < (gi + 1) * group; ++kk) {
        const uint32_t u = (uint32_t)x[b * k + kk] << 16;
        float f;
        __builtin_memcpy(&f, &u, 4);
        s += f;
      }
      sums[b * groups + gi] = s;
    }
}

void int4_gemv_blocks(const Int4Gemv& g, int64_t block0, int64_t block1) {
#if defined(__AVX512F__)
  if (g.x_bf16) return blocks_dot(g, block0, block1);
#endif
  if (g.block == 64) return blocks_of<64>(g, block0, block1);
  blocks_of<32>(g, block0, block1);
}

#if defined(__AVX512F__)
bool cpu_has_int4_dot() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
}
#else
bool cpu_has_int4_dot() { return false; }
#endif

}  // namespace kvmesh
