// Decode attention over KV pages where they lie: no gather of the context into a batch tensor.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {
namespace {

constexpr int kTile = 16;
constexpr int kChunk = kTile * 16;  // floats of one chunk of a tile's rows
constexpr int kPagesAhead = 2;  // pages past the current one asked for ahead

inline int element_bytes(int storage) { return storage == kF32 ? 4 : storage == kBF16 ? 2 : 1; }

// Ask for one head's block of a page ahead of use: pages of a context lie anywhere in the pool,
// so the hardware prefetcher cannot guess the next one.
void prefetch_block(const PagedKV& kv, int64_t page, int head) {
  const int size = element_bytes(kv.storage);
  const char* p = static_cast<const char*>(kv.data) + (page * kv.page_stride + head * kv.head_stride) * size;
  const int64_t bytes = kv.page_size * kv.slot_stride * size;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

inline int chunks(int dim) { return (dim + 15) / 16; }

// Row `slot` of a page, part `part`, `dim` values as fp32 into a tile buffer: chunk c (16 values)
// at dst + c * kTile * 16, so the same chunk of a tile's 16 rows is contiguous.
void load_row(const PagedKV& kv, int64_t page, int head, int slot, int part, int dim,
              float* dst) {
  int64_t at = page * kv.page_stride + head * kv.head_stride + slot * kv.slot_stride +
               part * kv.part_stride;
  int n = chunks(dim);
  if (kv.storage == kF32) {
    const float* p = static_cast<const float*>(kv.data) + at;
    for (int c = 0; c < n; ++c) _mm512_store_ps(dst + kChunk * c, load_f32(p + 16 * c, dim - 16 * c));
  } else if (kv.storage == kBF16) {
    const uint16_t* p = static_cast<const uint16_t*>(kv.data) + at;
    for (int c = 0; c < n; ++c) _mm512_store_ps(dst + kChunk * c, load_bf16(p + 16 * c, dim - 16 * c));
  } else {
    const int8_t* p = static_cast<const int8_t*>(kv.data) + at;
    int e = kv.exps[page * kv.exp_page + head * kv.exp_head + slot * kv.exp_slot +
                    part * kv.exp_part];
    __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, e + 8));  // exact: a power of two
    for (int c = 0; c < n; ++c)
      _mm512_store_ps(dst + kChunk * c, _mm512_mul_ps(load_fp8(p + 16 * c, dim - 16 * c), scale));
  }
}

// The scores of one head against the 16 key rows of a tile (rows past the tile's end are
// finite leftovers, masked by the caller): 16 independent FMA chains, then one transpose-sum.
inline __m512 tile_scores(const float* q, const float* keys, int nk) {
  __m512 acc[kTile];
#pragma GCC unroll 16
  for (int j = 0; j < kTile; ++j) acc[j] = _mm512_setzero_ps();
  for (int c = 0; c < nk; ++c, keys += kChunk) {
    const __m512 qc = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
    for (int j = 0; j < kTile; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_load_ps(keys + 16 * j), acc[j]);
  }
  return transpose_sum16(acc);
}

// kWidth chunks of acc = alpha acc + sum_j prob[j] values[j] (kWidth independent chains).
template <int kWidth>
inline void accumulate_block(float* acc, __m512 alpha, const float* prob, int n,
                             const float* values) {
  __m512 sum[kWidth];
#pragma GCC unroll 8
  for (int c = 0; c < kWidth; ++c) sum[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), alpha);
  for (int j = 0; j < n; ++j) {
    const __m512 p = _mm512_set1_ps(prob[j]);
#pragma GCC unroll 8
    for (int c = 0; c < kWidth; ++c)
      sum[c] = _mm512_fmadd_ps(p, _mm512_load_ps(values + kChunk * c + 16 * j), sum[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < kWidth; ++c) _mm512_storeu_ps(acc + 16 * c, sum[c]);
}

inline void accumulate(float* acc, int nv, float alpha, const float* prob, int n,
                       const float* values) {
  const __m512 a = _mm512_set1_ps(alpha);
  int c = 0;
  for (; c + 8 <= nv; c += 8) accumulate_block<8>(acc + 16 * c, a, prob, n, values + kChunk * c);
  if (c + 4 <= nv) accumulate_block<4>(acc + 16 * c, a, prob, n, values + kChunk * c), c += 4;
  if (c + 2 <= nv) accumulate_block<2>(acc + 16 * c, a, prob, n, values + kChunk * c), c += 2;
  if (c < nv) accumulate_block<1>(acc + 16 * c, a, prob, n, values + kChunk * c);
}

void load_query(const DecodeRows& rows, int b, int h, int dim, float* dst) {
  int64_t at = b * rows.q_row + h * rows.q_head;
  for (int c = 0; c < chunks(dim); ++c) {
    __m512 v = rows.bf16 ? load_bf16(static_cast<const uint16_t*>(rows.q) + at + 16 * c, dim - 16 * c)
                         : load_f32(static_cast<const float*>(rows.q) + at + 16 * c, dim - 16 * c);
    _mm512_storeu_ps(dst + 16 * c, v);
  }
}

void store_out(const DecodeRows& rows, int b, int h, int dim, const float* acc, float inv) {
  int64_t at = b * rows.out_row + h * rows.out_head;
  if (rows.bf16) {
    uint16_t* o = static_cast<uint16_t*>(rows.out) + at;
    for (int d = 0; d < dim; ++d) o[d] = to_bf16(acc[d] * inv);
  } else {
    float* o = static_cast<float*>(rows.out) + at;
    for (int d = 0; d < dim; ++d) o[d] = acc[d] * inv;
  }
}

}  // namespace

void paged_decode_item(const PagedKV& kv, const DecodeRows& rows, int b, int kv_head, int h0,
                       int h1) {
  const int nk = chunks(kv.k_dim), nv = chunks(kv.v_dim), heads = h1 - h0;
  const bool shared = kv.k_part == kv.v_part;  // MLA: V is the first v_dim dims of K's row
  thread_local std::vector<float> buf;  // q, acc, then 64-byte aligned key / value tiles
  const size_t need = (size_t)16 * (heads * (nk + nv) + kTile * (nk + (shared ? 0 : nv))) + 16;
  if (buf.size() < need) buf.resize(need);  // tile rows past a tile's end keep finite leftovers
  float* q = buf.data();
  float* acc = q + 16 * heads * nk;
  std::fill(acc, acc + 16 * heads * nv, 0.0f);
  float* keys = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc + 16 * heads * nv) + 63) & ~uintptr_t(63));
  float* values = shared ? keys : keys + kChunk * nk;
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity()), l(heads, 0.0f);
  for (int i = 0; i < heads; ++i) load_query(rows, b, h0 + i, kv.k_dim, q + 16 * nk * i);

  const int length = rows.lengths[b];
  const int32_t* table = rows.block_tables + b * rows.table_row;
  alignas(64) float prob[kTile];
  const int pages = (length + kv.page_size - 1) / kv.page_size;
  for (int p = 0; p < std::min(kPagesAhead, pages); ++p) prefetch_block(kv, table[p], kv_head);
  for (int t = 0; t < length;) {
    const int64_t page = table[t / kv.page_size];
    const int offset = t % kv.page_size;
    const int n = std::min({kTile, kv.page_size - offset, length - t});
    const int ahead = t / kv.page_size + kPagesAhead;
    if (offset == 0 && ahead < pages) prefetch_block(kv, table[ahead], kv_head);
    for (int j = 0; j < n; ++j) {
      load_row(kv, page, kv_head, offset + j, kv.k_part, kv.k_dim, keys + 16 * j);
      if (!shared) load_row(kv, page, kv_head, offset + j, kv.v_part, kv.v_dim, values + 16 * j);
    }
    const __mmask16 valid = tail_mask(n);
    for (int i = 0; i < heads; ++i) {
      __m512 s = _mm512_mul_ps(tile_scores(q + 16 * nk * i, keys, nk), _mm512_set1_ps(rows.scale));
      float top = std::max(m[i], _mm512_mask_reduce_max_ps(valid, s));
      float alpha = std::isinf(m[i]) ? 0.0f : std::exp(m[i] - top);
      __m512 p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(top))));
      l[i] = l[i] * alpha + _mm512_reduce_add_ps(p);
      m[i] = top;
      _mm512_store_ps(prob, p);
      accumulate(acc + 16 * nv * i, nv, alpha, prob, n, values);
    }
    t += n;
  }
  for (int i = 0; i < heads; ++i)
    store_out(rows, b, h0 + i, kv.v_dim, acc + 16 * nv * i, l[i] > 0 ? 1.0f / l[i] : 0.0f);
}

}  // namespace kvmesh
