#include "model/param_layout.h"

#include <cmath>

namespace xd {

size_t TensorSlot::numel() const {
  size_t n = 1;
  for (int64_t s : shape) n *= static_cast<size_t>(s);
  return n;
}

ParamLayout::ParamLayout(const ModelConfig& cfg, int first_expert, int num_local_experts)
    : cfg_(cfg),
      first_expert_(first_expert),
      num_local_experts_(num_local_experts < 0 ? cfg.num_experts : num_local_experts) {
  XD_CHECK(first_expert_ >= 0 && first_expert_ + num_local_experts_ <= cfg.num_experts);
  const int64_t d = cfg.hidden_size, V = cfg.vocab_size, hd = cfg.head_dim();
  const int64_t q = cfg.num_heads * hd, kv = cfg.num_kv_heads * hd;
  const int64_t ff = cfg.expert_intermediate_size, sff = cfg.shared_intermediate_size;

  auto add = [&](std::string name, std::vector<int64_t> shape, int layer = -1,
                 int expert = -1) {
    TensorSlot s;
    s.name = std::move(name);
    s.offset = size_;
    s.shape = std::move(shape);
    s.layer = layer;
    s.expert = expert;
    size_ += s.numel();
    slots_.push_back(std::move(s));
    return slots_.back().offset;
  };

  embed_ = add("model.embed_tokens.weight", {V, d});
  for (int l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string moe = p + "block_sparse_moe.";
    LayerOffsets o{};
    for (size_t& f : o.f) f = kAbsent;
    o.f[0] = add(p + "input_layernorm.weight", {d}, l);
    o.f[1] = add(p + "self_attn.q_proj.weight", {q, d}, l);
    o.f[2] = add(p + "self_attn.k_proj.weight", {kv, d}, l);
    o.f[3] = add(p + "self_attn.v_proj.weight", {kv, d}, l);
    o.f[4] = add(p + "self_attn.o_proj.weight", {d, q}, l);
    o.f[5] = add(p + "post_attention_layernorm.weight", {d}, l);
    o.f[6] = add(moe + "gate.weight", {cfg.router_rows(), d}, l);
    if (cfg.gating == Gating::kGShardNoisyTopK) o.f[13] = add(moe + "gate_noise.weight", {cfg.num_experts, d}, l);
    if (cfg.gating == Gating::kXMoe) {
      o.f[14] = add(moe + "gate_experts.weight", {cfg.num_experts, cfg.resolved_router_dim()}, l);
      o.f[15] = add(moe + "gate_log_scale", {1}, l);
    }
    // Each projection of all local experts is contiguous: (E_local, rows, cols).
    const char* proj[3] = {"w1", "w3", "w2"};
    for (int which = 0; which < 3; ++which) {
      std::vector<int64_t> shape = which == 2 ? std::vector<int64_t>{d, ff}
                                              : std::vector<int64_t>{ff, d};
      size_t first = size_;
      for (int j = 0; j < num_local_experts_; ++j) {
        int e = first_expert_ + j;
        add(moe + "experts." + std::to_string(e) + "." + proj[which] + ".weight", shape, l, e);
      }
      o.f[7 + which] = first;
    }
    for (int which = 0; which < 3; ++which) {
      std::vector<int64_t> shape = which == 2 ? std::vector<int64_t>{d, sff}
                                              : std::vector<int64_t>{sff, d};
      size_t first = size_;
      for (int j = 0; j < cfg.num_shared_experts; ++j)
        add(moe + "shared_experts." + std::to_string(j) + "." + proj[which] + ".weight", shape, l);
      o.f[10 + which] = first;
    }
    layer_offsets_.push_back(o);
  }
  final_norm_ = add("model.norm.weight", {d});
  lm_head_ = add("lm_head.weight", {V, d});
}

const TensorSlot* ParamLayout::find(const std::string& name) const {
  for (const TensorSlot& s : slots_)
    if (s.name == name) return &s;
  return nullptr;
}

std::string non_finite_tensors(const ParamLayout& layout, const float* values, const char* if_none) {
  std::string out;
  int listed = 0, more = 0;
  for (const TensorSlot& s : layout.slots()) {
    size_t bad = 0;
    for (size_t i = s.offset; i < s.offset + s.numel(); ++i) bad += !std::isfinite(values[i]);
    if (bad == 0) continue;
    if (listed++ < 4)
      out += (out.empty() ? "" : ", ") + s.name + " (" + std::to_string(bad) + " of " + std::to_string(s.numel()) + ")";
    else
      ++more;
  }
  if (more) out += " and " + std::to_string(more) + " more tensors";
  return out.empty() ? if_none : out;
}

std::vector<std::vector<std::pair<size_t, size_t>>> dense_gradient_buckets(const ParamLayout& layout) {
  const int layers = layout.config().num_layers;
  std::vector<std::vector<std::pair<size_t, size_t>>> buckets(layers + 2);
  for (const TensorSlot& s : layout.slots()) {
    if (s.is_routed_expert()) continue;
    const bool embedding = s.layer < 0 && s.name.find("embed_tokens") != std::string::npos;
    auto& ranges = buckets[s.layer >= 0 ? layers - s.layer : embedding ? layers + 1 : 0];
    if (!ranges.empty() && ranges.back().second == s.offset) ranges.back().second += s.numel();
    else ranges.emplace_back(s.offset, s.offset + s.numel());
  }
  return buckets;
}

}  // namespace xd
