// bf16 linears on Intel AMX tiles, for any batch up to 64 rows: y^T = W x^T with W's rows
// loaded as A tiles straight from the weight matrix (16 output rows x 32 k per tile), x packed
// once per call into B tiles (VNNI pairs: 16 k-pairs x 16 batch rows), fp32 C tiles. One tile
// product does 8,192 multiply-adds, so the weights stream at memory speed at every batch size
// (the AVX512-BF16 GEMV is compute bound above ~8 rows). Each output's sum depends only on its
// own x row and W row, in chunks of 32 k in order: the same bits whatever the batch.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"
#include "simd.h"

namespace kvmesh {

#if defined(__AVX512F__)

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: let this process use AMX tile data
constexpr long kXfeatureXtiledata = 18;
constexpr int kAhead = 8;  // k chunks (of 64 bytes per weight row) prefetched ahead

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool cpu_reports_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
}

// Tiles 0-3: C for batch blocks 0-3 (16 outputs x 16 batch rows, fp32); 4: A; 5: B.
__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

template <int kBlocks>
__attribute__((target("amx-tile,amx-bf16"))) void block16(const uint16_t* w, int64_t ldw,
                                                          const uint16_t* packed, int64_t chunks,
                                                          float* c_out) {
  _tile_zero(0);
  if (kBlocks > 1) _tile_zero(1);
  if (kBlocks > 2) _tile_zero(2);
  if (kBlocks > 3) _tile_zero(3);
  const int64_t stride = ldw * 2;
  for (int64_t c = 0; c < chunks; ++c) {
    if (c + kAhead < chunks)
      for (int r = 0; r < 16; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * ldw + (c + kAhead) * 32), _MM_HINT_T0);
    _tile_loadd(4, w + c * 32, stride);
    const uint16_t* b = packed + c * 512;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (kBlocks > 1) {
      _tile_loadd(5, b + chunks * 512, 64);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (kBlocks > 2) {
      _tile_loadd(5, b + 2 * chunks * 512, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (kBlocks > 3) {
      _tile_loadd(5, b + 3 * chunks * 512, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c_out, 64);
  if (kBlocks > 1) _tile_stored(1, c_out + 256, 64);
  if (kBlocks > 2) _tile_stored(2, c_out + 512, 64);
  if (kBlocks > 3) _tile_stored(3, c_out + 768, 64);
}

// A 16 x 16 fp32 tile (rows = outputs, lanes = batch rows) transposed: out[j] lane r = c[r][j].
// 32-bit then 64-bit unpacks within 128-bit lanes, then a 4 x 4 transpose of the lanes.
inline void transpose16(const float* c, __m512* out) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_load_ps(c + 32 * i), b = _mm512_load_ps(c + 32 * i + 16);
    t[2 * i] = _mm512_unpacklo_ps(a, b), t[2 * i + 1] = _mm512_unpackhi_ps(a, b);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int j = 0; j < 4; ++j) {  // u[4i + j] lane L holds rows 4i..4i+3 of batch row 4L + j
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
    out[j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    out[4 + j] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    out[8 + j] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    out[12 + j] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

// 16 fp32 -> bf16 with round-to-nearest-even, the same bits as to_bf16.
inline void store_bf16x16(uint16_t* dst, __m512 v) {
  __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

}  // namespace

bool cpu_has_amx() {
  static const bool ok = cpu_reports_amx() &&
                         syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

void amx_pack_x(const uint16_t* x, int64_t ldx, int batch, int64_t k, uint16_t* packed) {
  const int64_t chunks = k / 32;
  const int blocks = (batch + 15) / 16;
  std::memset(packed, 0, (size_t)blocks * chunks * 1024);
  for (int m = 0; m < batch; ++m)
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* dst = packed + ((m / 16) * chunks + c) * 512 + (m % 16) * 2;
      const uint16_t* src = x + m * ldx + c * 32;
      for (int kk = 0; kk < 16; ++kk) dst[kk * 32] = src[2 * kk], dst[kk * 32 + 1] = src[2 * kk + 1];
    }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_linear_rows(
    const uint16_t* packed, int batch, const uint16_t* w, int64_t ldw, int64_t k,
    const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t block0, int64_t block1) {
  configure_tiles();
  const int64_t chunks = k / 32;
  const int blocks = (batch + 15) / 16;
  alignas(64) float c[4 * 256];
  for (int64_t nb = block0; nb < block1; ++nb) {
    const uint16_t* wb = w + nb * 16 * ldw;
    switch (blocks) {
      case 1: block16<1>(wb, ldw, packed, chunks, c); break;
      case 2: block16<2>(wb, ldw, packed, chunks, c); break;
      case 3: block16<3>(wb, ldw, packed, chunks, c); break;
      default: block16<4>(wb, ldw, packed, chunks, c); break;
    }
    const __m512 add = bias ? load_bf16(bias + nb * 16, 16).v : _mm512_setzero_ps();
    for (int m0 = 0; m0 < batch; m0 += 16) {
      __m512 rows[16];
      transpose16(c + (m0 / 16) * 256, rows);  // rows[j]: the 16 outputs of batch row m0 + j
      for (int j = 0; j < std::min(16, batch - m0); ++j)
        store_bf16x16(y + (m0 + j) * ldy + nb * 16, _mm512_add_ps(rows[j], add));
    }
  }
  _tile_release();
}

#else  // AVX2 build: no AMX (every AMX CPU has AVX-512), so these are never called

bool cpu_has_amx() { return false; }
void amx_pack_x(const uint16_t*, int64_t, int, int64_t, uint16_t*) {}
void amx_linear_rows(const uint16_t*, int, const uint16_t*, int64_t, int64_t, const uint16_t*,
                     uint16_t*, int64_t, int64_t, int64_t) {}

#endif

}  // namespace kvmesh
