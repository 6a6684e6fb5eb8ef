// Plain-pointer kernel entry points; ops.cpp wraps them for torch and splits the work across
// torch's own thread pool (at::parallel_for), so the kernels never start threads themselves.
#pragma once

#include <cstdint>

namespace kvmesh {

// One layer's paged KV as the pool lays it out (kv/layout.py): element strides of the data
// view [page, head, slot, part, dim] and, for FP8, of the int8 exponents [page, head, slot, part].
struct PagedKV {
  const void* data;
  const int8_t* exps;  // FP8 only: value = e4m3(byte) * 2**exp
  int storage;         // simd.h Storage
  int64_t page_stride, head_stride, slot_stride, part_stride;
  int64_t exp_page, exp_head, exp_slot, exp_part;
  int page_size;
  int k_part, v_part;  // GQA: K = part 0, V = part 1; MLA: both part 0 (V = first v_dim dims)
  int k_dim, v_dim;
};

// Decode rows: query b attends over lengths[b] tokens whose pages are block_tables[b, :].
struct DecodeRows {
  const void* q;  // [B, H, k_dim], fp32 or bf16
  bool bf16;      // q and out dtype
  int64_t q_row, q_head;
  void* out;  // [B, H, v_dim]
  int64_t out_row, out_head;
  const int32_t* block_tables;
  int64_t table_row;
  const int32_t* lengths;
  int num_heads, num_kv_heads;
  float scale;
};

// Query heads [h0, h1) of row b, all of KV head kv_head's group: online softmax over the
// context in tiles of up to 16 tokens of one page, everything in fp32. While it runs, the
// pages ahead are asked for: its own, then those of the item the caller runs next (next_b,
// next_kv_head; next_b -1: none).
void paged_decode_item(const PagedKV& kv, const DecodeRows& rows, int b, int kv_head, int h0,
                       int h1, int next_b, int next_kv_head);

// y[b, n] = bf16(sum_k x[b, k] w[n, k] + bias[n]) for rows n in [n0, n1); x, w, bias, y bf16;
// any batch (above 8 in register tiles). The sum over k runs in a fixed order whatever the
// batch or the row range (bf16_dot.h).
void gemv_bf16(const uint16_t* x, int64_t ldx, int batch, const uint16_t* w, int64_t ldw,
               int64_t k, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1,
               bool dot_bf16);

// y[b, n] = sum_k x[b, k] w[n, k] + bias[n] for rows n in [n0, n1); all fp32; batch <=
// gemv_f32_max_batch() (8 with AVX-512, 4 with AVX2). The sum over k runs in a fixed order
// whatever the batch or the row range.
int gemv_f32_max_batch();
void gemv_f32(const float* x, int64_t ldx, int batch, const float* w, int64_t ldw, int64_t k,
              const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1);

// INT4 weights in torch's CPU int4pack layout of `block` (32 or 64) row blocks (see
// int4_gemv.cpp); x fp32 [batch, k] with its per-group sums group_sums [batch, k / group];
// y [batch, n] fp32 or bf16; batch <= 16 (a row block 4 batch rows at a time).
struct Int4Gemv {
  const float* x;
  const float* group_sums;  // with x_bf16 optional: int4_group_sums_bf16's, made once per x
  const uint16_t* x_bf16;   // set instead of x: bf16 x by pairs of inputs (below)
  int batch;
  const uint8_t* packed;
  int block;
  const void* scales_zeros;  // [k / group, n, 2], bf16 or fp32 (as y)
  bool bf16;
  int64_t n, k, group;
  void* y;
};

// Output rows of the row blocks [block0, block1).
void int4_gemv_blocks(const Int4Gemv& g, int64_t block0, int64_t block1);
// sums [batch, k / group]: each bf16 x row's sum per group, in k order (what a call with x_bf16
// and no group_sums computes for itself)
void int4_group_sums_bf16(const uint16_t* x, int batch, int64_t k, int64_t group, float* sums);
// Whether bf16 x may go as x_bf16 (64-row blocks; AVX512-BF16 and VBMI on this CPU).
bool cpu_has_int4_dot();

// RMSNorm of rows [row0, row1) of x [rows, dim] (fp32 or bf16, weight alike); with residual,
// of x + residual, whose sum also goes to sum_out.
struct NormRows {
  const void* x;
  const void* residual;  // nullable
  const void* weight;
  void* out;
  void* sum_out;
  bool bf16;
  int64_t dim;
  float eps;
};

void rms_norm_rows(const NormRows& r, int64_t row0, int64_t row1);

// out[row] = argmax of logits[row, :width] (first maximum), -1 where the row holds a NaN.
void argmax_rows(const void* logits, bool bf16, int64_t width, int64_t stride, int64_t* out,
                 int64_t row0, int64_t row1);

// Rotary embedding (rotate-half form) of x [T, heads, dim] (row / head strides, dim contiguous)
// with cos / sin [T, dim] into out [T, heads, dim] (contiguous); fp32 or bf16 throughout.
struct RopeRows {
  const void* x;
  const void* cos;
  const void* sin;
  void* out;
  bool bf16;
  int heads;
  int64_t dim, row_stride, head_stride, out_row;
};

void rope_rows(const RopeRows& r, int64_t row0, int64_t row1);

bool cpu_has_bf16_dot();

// AMX (amx_linear.cpp): true once this process may use AMX tile data (asked of Linux once).
bool cpu_has_amx();
// x [batch <= 64, k] bf16 -> B tiles: per 16-row batch block, per 32-k chunk, 16 k-pairs x 16.
void amx_pack_x(const uint16_t* x, int64_t ldx, int batch, int64_t k, uint16_t* packed);
// y rows for the 16-row weight blocks [block0, block1); k % 32 == 0.
void amx_linear_rows(const uint16_t* packed, int batch, const uint16_t* w, int64_t ldw, int64_t k,
                     const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t block0,
                     int64_t block1);

}  // namespace kvmesh
