// Decode attention over KV pages where they lie: no gather of the context into a batch tensor.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "sums.h"

namespace kvmesh {
namespace {

constexpr int kTile = 16;
constexpr int kPagesAhead = 2;  // pages past the current one asked for ahead

inline int element_bytes(int storage) { return storage == kF32 ? 4 : storage == kBF16 ? 2 : 1; }

// One head's block of a page: its rows, token after token.
inline const char* block_at(const PagedKV& kv, int64_t page, int head) {
  return static_cast<const char*>(kv.data) + (page * kv.page_stride + head * kv.head_stride) * element_bytes(kv.storage);
}

// Ask for one head's block of a page ahead of use: pages of a context lie anywhere in the pool,
// so the hardware prefetcher cannot guess the next one.
void prefetch_block(const PagedKV& kv, int64_t page, int head) {
  const int size = element_bytes(kv.storage);
  const char* p = block_at(kv, page, head);
  const int64_t bytes = kv.page_size * kv.slot_stride * size;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

inline int chunks(int dim) { return (dim + 15) / 16; }

// The rows of one tile (up to kTile tokens of one page) as they lie in the page: element
// offsets of each token's K and V rows and, for FP8, their scales 2**(exp + 8). Rows past the
// tile's end repeat its last row (finite values, masked by the caller).
struct TileRows {
  int64_t k[kTile], v[kTile];
  float k_scale[kTile], v_scale[kTile];
  const char* ahead;  // this tile's first row in the page kPagesAhead on, or null
  int64_t row_bytes;  // bytes from one token's rows to the next's
};

// The rows of tokens j and j + 1 of the page ahead, asked for into L2 while this tile's pair is
// computed: a few lines per pair keep the misses in flight steady, where a whole page asked for
// at once (64 lines) stalled on the core's miss buffers; into L2, not L1, because an L1
// prefetch holds one of L1's few miss buffers until its line arrives (the prefetch then took
// a third of the kernel's samples; into L2 the kernel runs 1.5x faster from DRAM).
inline void prefetch_pair(const TileRows& t, int j) {
  if (t.ahead == nullptr) return;
  const char* p = t.ahead + j * t.row_bytes;
  for (int64_t i = 0; i < 2 * t.row_bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
}

// 2**e exactly: the float's exponent bits where e is a normal exponent (every scale FP8 pages
// hold), std::ldexp elsewhere (a library call: 32 per tile cost ~10 % of an FP8 layer).
inline float pow2(int e) {
  if (e < -126 || e > 127) return std::ldexp(1.0f, e);
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <int S>
void tile_rows(const PagedKV& kv, int64_t page, int head, int offset, int n, TileRows& t) {
  for (int j = 0; j < kTile; ++j) {
    const int64_t slot = offset + std::min(j, n - 1);
    const int64_t row = page * kv.page_stride + head * kv.head_stride + slot * kv.slot_stride;
    t.k[j] = row + kv.k_part * kv.part_stride;
    t.v[j] = row + kv.v_part * kv.part_stride;
    if (S == kFP8) {
      const int64_t e = page * kv.exp_page + head * kv.exp_head + slot * kv.exp_slot;
      t.k_scale[j] = pow2(kv.exps[e + kv.k_part * kv.exp_part] + 8);
      t.v_scale[j] = pow2(kv.exps[e + kv.v_part * kv.exp_part] + 8);
    }
  }
}

// 16 values of a stored row from element `at` as fp32 (lanes past `n` zero), FP8 ones without
// their row's power-of-two scale (x 2**-8 only): the caller applies it once per token -- to the
// token's score, to its probability -- which gives the same bits as scaling every element, since
// multiplying by a power of two commutes with every rounding in between, as long as nothing falls
// to a subnormal float (a probability times a scale below 2**-126: scales that small only come
// with KV values below ~1e-30, and such a term could only change a sum that is itself that small).
template <int S>
inline Vec load_unscaled(const void* data, int64_t at, int n) {
  if (S == kF32) return load_f32(static_cast<const float*>(data) + at, n);
  if (S == kBF16) return load_bf16(static_cast<const uint16_t*>(data) + at, n);
  return load_fp8(static_cast<const int8_t*>(data) + at, n);
}

// Chunks c and c + 1 of a stored row (32 values from element `at`, lanes past n zero), unscaled
// as above: FP8 bytes widened 32 at a time (one widening, shift and mask for both chunks: ~6 %
// of an FP8 layer on the AVX-512 EPYC); bf16 and fp32 pages keep loading chunk by chunk.
template <int S>
inline void load_unscaled_pair(const void* data, int64_t at, int n, Vec* out) {
  if (S == kFP8) return load_fp8_pair(static_cast<const int8_t*>(data) + at, n, out[0], out[1]);
  out[0] = load_unscaled<S>(data, at, n);
  out[1] = load_unscaled<S>(data, at + 16, n - 16);
}

// The scores of up to 3 heads of a group against the 16 key rows of a tile: each key chunk is
// loaded and converted once for all of them, 2 tokens at a time (6 accumulators, which fit AVX2's
// 16 ymm; on AVX-512 this beat one head at a time over 16 accumulators by ~5 % in an interleaved
// A/B). Each score is one FMA chain over the chunks in order, then one transpose-sum per head.
template <int S, int kHeads>
inline void tile_scores_heads(const PagedKV& kv, const TileRows& t, const float* q, int nk, Vec* out) {
  Vec acc[kHeads][kTile];
  for (int j = 0; j < kTile; j += 2) {
    prefetch_pair(t, j);
    Vec a[kHeads][2];
#pragma GCC unroll 3
    for (int h = 0; h < kHeads; ++h) a[h][0] = a[h][1] = zero();
    int c = 0;
    if constexpr (S == kFP8) {  // chunks in order, two at a time: the same FMA chains
      for (; c + 1 < nk; c += 2) {
        Vec k0[2], k1[2];
        load_unscaled_pair<S>(kv.data, t.k[j] + 16 * c, kv.k_dim - 16 * c, k0);
        load_unscaled_pair<S>(kv.data, t.k[j + 1] + 16 * c, kv.k_dim - 16 * c, k1);
        for (int i = 0; i < 2; ++i) {
#pragma GCC unroll 3
          for (int h = 0; h < kHeads; ++h) {
            const Vec qc = loadu(q + 16 * (nk * h + c + i));
            a[h][0] = fmadd(qc, k0[i], a[h][0]);
            a[h][1] = fmadd(qc, k1[i], a[h][1]);
          }
        }
      }
    }
    for (; c < nk; ++c) {
      const int n = kv.k_dim - 16 * c;
      const Vec k0 = load_unscaled<S>(kv.data, t.k[j] + 16 * c, n);
      const Vec k1 = load_unscaled<S>(kv.data, t.k[j + 1] + 16 * c, n);
#pragma GCC unroll 3
      for (int h = 0; h < kHeads; ++h) {
        const Vec qc = loadu(q + 16 * (nk * h + c));
        a[h][0] = fmadd(qc, k0, a[h][0]);
        a[h][1] = fmadd(qc, k1, a[h][1]);
      }
    }
#pragma GCC unroll 3
    for (int h = 0; h < kHeads; ++h) acc[h][j] = a[h][0], acc[h][j + 1] = a[h][1];
  }
#pragma GCC unroll 3
  for (int h = 0; h < kHeads; ++h) {
    out[h] = transpose_sum16(acc[h]);
    if (S == kFP8) out[h] = mul(out[h], loadu(t.k_scale));  // lane j: token j's score
  }
}

// The scores of `heads` heads (q: each head's k_dim values, 16 * nk apart) against a tile.
template <int S>
inline void tile_scores_all(const PagedKV& kv, const TileRows& t, const float* q, int nk, int heads,
                            Vec* out) {
  for (int i = 0; i < heads; i += 3) {
    switch (std::min(3, heads - i)) {
      case 1: tile_scores_heads<S, 1>(kv, t, q + 16 * nk * i, nk, out + i); break;
      case 2: tile_scores_heads<S, 2>(kv, t, q + 16 * nk * i, nk, out + i); break;
      default: tile_scores_heads<S, 3>(kv, t, q + 16 * nk * i, nk, out + i); break;
    }
  }
}

// For kHeads heads at once, kWidth chunks of each head's acc = alpha acc + sum_j prob[j] v[j]:
// each value chunk is loaded once for every head (kHeads x kWidth independent chains).
template <int S, int kHeads, int kWidth>
inline void accumulate_block(const PagedKV& kv, const TileRows& t, int c0, float* const* acc,
                             const float* alpha, const float (*prob)[kTile], int n) {
  Vec sum[kHeads][kWidth];
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < kWidth; ++c)
      sum[h][c] = mul(loadu(acc[h] + 16 * (c0 + c)), set1(alpha[h]));
  for (int j = 0; j < n; ++j) {
    Vec p[kHeads];
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) p[h] = set1(S == kFP8 ? prob[h][j] * t.v_scale[j] : prob[h][j]);
    int c = 0;
    if constexpr (S == kFP8) {
      for (; c + 1 < kWidth; c += 2) {
        Vec v[2];
        load_unscaled_pair<S>(kv.data, t.v[j] + 16 * (c0 + c), kv.v_dim - 16 * (c0 + c), v);
#pragma GCC unroll 8
        for (int h = 0; h < kHeads; ++h) {
          sum[h][c] = fmadd(p[h], v[0], sum[h][c]);
          sum[h][c + 1] = fmadd(p[h], v[1], sum[h][c + 1]);
        }
      }
    }
#pragma GCC unroll 8
    for (; c < kWidth; ++c) {
      const Vec v = load_unscaled<S>(kv.data, t.v[j] + 16 * (c0 + c), kv.v_dim - 16 * (c0 + c));
#pragma GCC unroll 8
      for (int h = 0; h < kHeads; ++h) sum[h][c] = fmadd(p[h], v, sum[h][c]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < kWidth; ++c) storeu(acc[h] + 16 * (c0 + c), sum[h][c]);
}

template <int S, int kHeads>
inline void accumulate_heads(const PagedKV& kv, const TileRows& t, int nv, float* const* acc,
                             const float* alpha, const float (*prob)[kTile], int n) {
#if defined(__AVX512F__)
  constexpr int kWide = 24 / kHeads >= 8 ? 8 : 4;  // at most 24 accumulators (of 32 zmm)
#else
  constexpr int kWide = kHeads == 1 ? 4 : 2;  // at most 6 accumulators (12 of 16 ymm)
#endif
  int c = 0;
  for (; c + kWide <= nv; c += kWide) accumulate_block<S, kHeads, kWide>(kv, t, c, acc, alpha, prob, n);
  if (c + 4 <= nv) accumulate_block<S, kHeads, 4>(kv, t, c, acc, alpha, prob, n), c += 4;
  if (c + 2 <= nv) accumulate_block<S, kHeads, 2>(kv, t, c, acc, alpha, prob, n), c += 2;
  if (c < nv) accumulate_block<S, kHeads, 1>(kv, t, c, acc, alpha, prob, n);
}

void load_query(const DecodeRows& rows, int b, int h, int dim, float* dst) {
  int64_t at = b * rows.q_row + h * rows.q_head;
  for (int c = 0; c < chunks(dim); ++c) {
    const Vec v = rows.bf16 ? load_bf16(static_cast<const uint16_t*>(rows.q) + at + 16 * c, dim - 16 * c)
                              : load_f32(static_cast<const float*>(rows.q) + at + 16 * c, dim - 16 * c);
    storeu(dst + 16 * c, v);
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

template <int S>
void decode_item(const PagedKV& kv, const DecodeRows& rows, int b, int kv_head, int h0, int h1,
                 int next_b, int next_kv_head) {
  constexpr int kMaxHeads = 3;  // heads whose values one pass accumulates
  const int nk = chunks(kv.k_dim), nv = chunks(kv.v_dim), heads = h1 - h0;
  thread_local std::vector<float> buf;  // q, acc, then per head its m, l, alpha, probabilities
  const size_t need = (size_t)16 * heads * (nk + nv);
  if (buf.size() < need) buf.resize(need);
  float* q = buf.data();
  float* acc = q + 16 * heads * nk;
  std::fill(acc, acc + 16 * heads * nv, 0.0f);
  // per head: running max, sum, rescale factor, accumulator, a tile's probabilities and scores
  // (kept by the thread: no allocation per item once they have grown)
  thread_local std::vector<float> m, l, alpha;
  thread_local std::vector<float*> acc_of;
  thread_local std::vector<std::array<float, kTile>> prob;
  thread_local std::vector<Vec> scores;
  m.assign(heads, -std::numeric_limits<float>::infinity()), l.assign(heads, 0.0f);
  alpha.resize(heads), acc_of.resize(heads), prob.resize(heads), scores.resize(heads);
  for (int i = 0; i < heads; ++i) {
    load_query(rows, b, h0 + i, kv.k_dim, q + 16 * nk * i);
    acc_of[i] = acc + 16 * nv * i;
  }
  const int length = rows.lengths[b];
  const int32_t* table = rows.block_tables + b * rows.table_row;
  const int pages = (length + kv.page_size - 1) / kv.page_size;
  // past this item's last pages, the next item's first ones are asked for
  const int32_t* next_table = next_b < 0 ? nullptr : rows.block_tables + next_b * rows.table_row;
  const int next_pages = next_b < 0 ? 0 : (rows.lengths[next_b] + kv.page_size - 1) / kv.page_size;
  for (int p = 0; p < std::min(kPagesAhead, pages); ++p) prefetch_block(kv, table[p], kv_head);
  TileRows t;
  t.row_bytes = kv.slot_stride * element_bytes(kv.storage);
  for (int pos = 0; pos < length;) {
    const int64_t page = table[pos / kv.page_size];
    const int offset = pos % kv.page_size;
    const int n = std::min({kTile, kv.page_size - offset, length - pos});
    const int ahead = pos / kv.page_size + kPagesAhead;
    tile_rows<S>(kv, page, kv_head, offset, n, t);
    int64_t ahead_page = -1;  // the page kPagesAhead on: this item's, else the next item's
    int ahead_head = kv_head;
    if (ahead < pages) {
      ahead_page = table[ahead];
    } else if (ahead - pages < next_pages) {
      ahead_page = next_table[ahead - pages], ahead_head = next_kv_head;
    }
    t.ahead = ahead_page < 0 ? nullptr : block_at(kv, ahead_page, ahead_head) + offset * t.row_bytes;
    if (S == kFP8 && ahead_page >= 0) {  // its scales: one line per page and head, an array apart
      const int64_t e = ahead_page * kv.exp_page + ahead_head * kv.exp_head + offset * kv.exp_slot;
      _mm_prefetch(reinterpret_cast<const char*>(kv.exps + e), _MM_HINT_T1);
    }
    tile_scores_all<S>(kv, t, q, nk, heads, scores.data());
    for (int i = 0; i < heads; ++i) {
      const Vec s = mul(scores[i], set1(rows.scale));
      const float top = std::max(m[i], hmax(first(n, s, -std::numeric_limits<float>::infinity())));
      alpha[i] = std::isinf(m[i]) ? 0.0f : std::exp(m[i] - top);
      const Vec p = first(n, exp_neg(sub(s, set1(top))), 0.0f);
      l[i] = l[i] * alpha[i] + hsum(p);
      m[i] = top;
      storeu(prob[i].data(), p);
    }
    using Probs = const float (*)[kTile];
    for (int i = 0; i < heads; i += kMaxHeads) {
      const auto pr = reinterpret_cast<Probs>(prob[i].data());
      switch (std::min(kMaxHeads, heads - i)) {
        case 1: accumulate_heads<S, 1>(kv, t, nv, &acc_of[i], &alpha[i], pr, n); break;
        case 2: accumulate_heads<S, 2>(kv, t, nv, &acc_of[i], &alpha[i], pr, n); break;
        default: accumulate_heads<S, 3>(kv, t, nv, &acc_of[i], &alpha[i], pr, n); break;
      }
    }
    pos += n;
  }
  for (int i = 0; i < heads; ++i)
    store_out(rows, b, h0 + i, kv.v_dim, acc_of[i], l[i] > 0 ? 1.0f / l[i] : 0.0f);
}

}  // namespace

void paged_decode_item(const PagedKV& kv, const DecodeRows& rows, int b, int kv_head, int h0,
                       int h1, int next_b, int next_kv_head) {
  switch (kv.storage) {
    case kF32: return decode_item<kF32>(kv, rows, b, kv_head, h0, h1, next_b, next_kv_head);
    case kBF16: return decode_item<kBF16>(kv, rows, b, kv_head, h0, h1, next_b, next_kv_head);
    default: return decode_item<kFP8>(kv, rows, b, kv_head, h0, h1, next_b, next_kv_head);
  }
}

}  // namespace kvmesh
