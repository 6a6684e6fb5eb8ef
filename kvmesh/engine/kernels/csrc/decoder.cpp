// The decode forward of a dense GQA decoder (the Llama family: RMSNorm, fused q/k/v with optional
// bias, full-width RoPE, paged attention, gated SiLU MLP; dense or INT4 weights) as one op. It
// calls the same op bodies in the same order as models/base.py's eager forward, so its bits are
// the eager step's; what it saves is a Python call and a dispatcher round per op (~20 per layer).
// The weights are registered once (register_decoder); a step passes only its own tensors. Steps of
// bf16 rows whose linears are all GEMV or small-batch INT4 kernels run in one parallel region
// instead (decoder_rows.cpp), the same kernels in the same order.
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "decoder.h"
#include "ops.h"

namespace {

using namespace kvmesh::decoder;

std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<const Decoder>>& registry() {
  static std::unordered_map<int64_t, std::shared_ptr<const Decoder>> decoders;
  return decoders;
}

void register_decoder(int64_t key, torch::Tensor embed, std::vector<torch::Tensor> tensors,
                      std::vector<int64_t> int4, std::vector<int64_t> kv_keys, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, double eps, double scale) {
  TORCH_CHECK(tensors.size() == kv_keys.size() * kPerLayer, kPerLayer, " tensors per layer");
  TORCH_CHECK(int4.size() == kv_keys.size() * 8, "a group size and row block per layer and role");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads a multiple of KV heads");
  auto d = std::make_shared<Decoder>(Decoder{embed, std::move(tensors), std::move(int4),
                                             std::move(kv_keys), heads, kv_heads, head_dim, eps,
                                             scale});
  std::lock_guard<std::mutex> hold(registry_mutex);
  registry()[key] = std::move(d);
}

void forget_decoder(int64_t key) {
  std::lock_guard<std::mutex> hold(registry_mutex);
  registry().erase(key);
}

std::shared_ptr<const Decoder> decoder_of(int64_t key) {
  std::lock_guard<std::mutex> hold(registry_mutex);
  auto found = registry().find(key);
  TORCH_CHECK(found != registry().end(), "no decoder registered under key ", key);
  return found->second;
}

c10::optional<torch::Tensor> bias_of(const torch::Tensor& b) {
  if (b.numel() == 0) return c10::nullopt;
  return b;
}

// One role's linear of layer `layer` through the kernel chosen for this step's rows: what
// layers/linear.py's dense_matmul, Int4Linear and BiasedInt4Linear (product, then + bias) run.
torch::Tensor linear(const Decoder& d, size_t layer, Role role, const torch::Tensor& x,
                     int64_t kernel) {
  const torch::Tensor* w = d.role(layer, role);
  const int64_t group = d.group(layer, role), block = d.block(layer, role);
  switch (kernel) {
    case kGemv:
      return x.scalar_type() == torch::kFloat ? kvmesh::ops::linear_f32(x, w[0], bias_of(w[1]))
                                              : kvmesh::ops::linear_bf16(x, w[0], bias_of(w[1]));
    case kAmx: return kvmesh::ops::linear_bf16_amx(x, w[0], bias_of(w[1]));
    case kTorch: return at::linear(x, w[0], bias_of(w[1]));
    case kWeightLeft: {
      auto y = at::mm(w[0], x.t()).t().contiguous();
      return w[1].numel() ? y + w[1] : y;
    }
    default: {
      auto y = kernel == kInt4Small ? kvmesh::ops::int4_linear(x, w[0], group, w[2], block)
                                    : at::_weight_int4pack_mm_for_cpu(x, w[0], group, w[2]);
      return w[1].numel() ? y + w[1] : y;
    }
  }
}

// The step (decoder.h Step) -> [hidden [T, H] before the final norm, captured layers' outputs...].
std::vector<torch::Tensor> decoder_forward(int64_t key, torch::Tensor ids, torch::Tensor cos,
                                           torch::Tensor sin, torch::Tensor page,
                                           torch::Tensor offset, torch::Tensor block_tables,
                                           torch::Tensor lengths, std::vector<int64_t> kernels,
                                           std::vector<int64_t> capture) {
  const auto d = decoder_of(key);
  TORCH_CHECK(kernels.size() == 4, "one linear kernel per role");
  const Step step{ids, cos, sin, page, offset, block_tables, lengths, kernels, capture};
  if (rows_fit(*d, step)) return rows_forward(*d, step);
  const int64_t q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
  auto h = at::embedding(d->embed, ids);
  std::vector<torch::Tensor> out{h};
  for (size_t i = 0; i < d->kv_keys.size(); ++i) {
    const torch::Tensor* norms = d->tensors.data() + i * kPerLayer;
    // models/base.py DecoderModel.forward, layers/gqa.py GqaAttention.__call__
    const auto x = kvmesh::ops::rms_norm_only(h, norms[0], d->eps);
    const auto qkv = linear(*d, i, kQkv, x, kernels[kQkv]).split({q_size, kv_size, kv_size}, -1);
    const auto q = kvmesh::ops::rope(qkv[0].view({-1, d->heads, d->head_dim}), cos, sin);
    const auto k = kvmesh::ops::rope(qkv[1].view({-1, d->kv_heads, d->head_dim}), cos, sin);
    const auto v = qkv[2].reshape({-1, d->kv_heads, d->head_dim});
    const auto attended = kvmesh::ops::paged_write_decode(
        q, at::stack({k, v}, -2), d->kv_keys[i], page, offset, block_tables, lengths, 1,
        d->head_dim, d->scale);
    const auto o = linear(*d, i, kO, attended.reshape({-1, q_size}), kernels[kO]);
    const auto [normed, total] = kvmesh::ops::add_rms_norm(h, o, norms[1], d->eps);
    // layers/mlp.py GatedMLP.__call__, then the residual add
    const auto gate_up = linear(*d, i, kGateUp, normed, kernels[kGateUp]);
    h = total + linear(*d, i, kDown, kvmesh::ops::silu_mul(gate_up), kernels[kDown]);
    if (std::find(capture.begin(), capture.end(), (int64_t)i) != capture.end()) out.push_back(h);
  }
  out[0] = h;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("register_decoder(int key, Tensor embed, Tensor[] tensors, int[] int4, int[] kv_keys, "
        "int heads, int kv_heads, int head_dim, float eps, float scale) -> ()",
        &register_decoder);
  m.def("forget_decoder(int key) -> ()", &forget_decoder);
  m.def("decoder_forward(int key, Tensor ids, Tensor cos, Tensor sin, Tensor page, "
        "Tensor offset, Tensor block_tables, Tensor lengths, int[] kernels, int[] capture) "
        "-> Tensor[]",
        &decoder_forward);
}
