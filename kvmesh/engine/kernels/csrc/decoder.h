// The registered decoders of decoder.cpp, shared with decoder_rows.cpp (its one-region path).
#pragma once
#include <torch/extension.h>

#include <memory>
#include <vector>

namespace kvmesh::decoder {

// Per layer: input norm, post norm, then per role (qkv, o, gate|up, down) the weight (dense, or
// INT4 packed), its bias and, for INT4, its scales and zeros. An absent tensor is empty.
constexpr int kPerLayer = 2 + 4 * 3;
enum Role { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
// fused_decode.py's kernels: layers/linear.py dense_kernel()'s, then quant/int4.py's two
enum Kernel { kGemv = 0, kAmx = 1, kTorch = 2, kInt4Small = 3, kInt4Torch = 4, kWeightLeft = 5 };

struct Decoder {
  torch::Tensor embed;
  std::vector<torch::Tensor> tensors;  // kPerLayer per layer
  std::vector<int64_t> int4;           // per layer and role: INT4 group size and row block, or 0 0
  std::vector<int64_t> kv_keys;        // the KV layer (kv_write.cpp) of each layer
  int64_t heads, kv_heads, head_dim;
  double eps, scale;

  // role's [weight or INT4 packed, bias, INT4 scales|zeros] of `layer`
  const torch::Tensor* role(size_t layer, Role r) const {
    return tensors.data() + layer * kPerLayer + 2 + 3 * r;
  }
  int64_t group(size_t layer, Role r) const { return int4[(layer * 4 + r) * 2]; }
  int64_t block(size_t layer, Role r) const { return int4[(layer * 4 + r) * 2 + 1]; }
};

// The step's inputs: ids [T] int64; cos / sin [T, 1, head_dim]; page, offset [T] int64: where
// each row's new K/V goes; block_tables [T, W], lengths [T] int32; kernels [4]: the linear
// kernel of each role at T rows; capture: layers whose outputs are returned too.
struct Step {
  torch::Tensor ids, cos, sin, page, offset, block_tables, lengths;
  std::vector<int64_t> kernels, capture;
};

// decoder_rows.cpp: whether a step of `d` runs in one parallel region (bf16 rows whose every
// linear is the GEMV or the INT4 small-batch kernel with bf16 x), and that run.
bool rows_fit(const Decoder& d, const Step& s);
std::vector<torch::Tensor> rows_forward(const Decoder& d, const Step& s);

}  // namespace kvmesh::decoder
