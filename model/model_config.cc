#include "model/model_config.h"

#include <cmath>

namespace xd {

namespace {
Status bad(const std::string& key, const std::string& why) {
  return Status::invalid_argument("model." + key + ": " + why);
}
}  // namespace

Status ModelConfig::validate() const {
  if (vocab_size <= 0) return bad("vocab_size", "must be positive");
  if (hidden_size <= 0) return bad("hidden_size", "must be positive");
  if (num_layers <= 0) return bad("num_layers", "must be positive");
  if (num_heads <= 0) return bad("num_heads", "must be positive");
  if (hidden_size % num_heads != 0) return bad("num_heads", "must divide hidden_size");
  if (head_dim() % 2 != 0) return bad("num_heads", "head_dim must be even for RoPE");
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
    return bad("num_kv_heads", "must be positive and divide num_heads");
  if (max_seq_len <= 0) return bad("max_seq_len", "must be positive");
  if (num_experts <= 0) return bad("num_experts", "must be positive");
  if (top_k <= 0 || top_k > num_experts) return bad("top_k", "must be in 1..num_experts");
  if (expert_intermediate_size <= 0) return bad("expert_intermediate_size", "must be positive");
  if (num_shared_experts < 0) return bad("num_shared_experts", "must be >= 0");
  if (num_shared_experts > 0 && shared_intermediate_size <= 0)
    return bad("shared_intermediate_size", "must be positive");
  if (!(capacity_factor >= 0) || !std::isfinite(capacity_factor))
    return bad("capacity_factor", "must be >= 0 (0 = dropless)");
  if (!(aux_loss_coef >= 0)) return bad("aux_loss_coef", "must be >= 0");
  if (!(z_loss_coef >= 0)) return bad("z_loss_coef", "must be >= 0");
  if (!(rope_theta > 0)) return bad("rope_theta", "must be positive");
  if (!(rms_norm_eps > 0)) return bad("rms_norm_eps", "must be positive");
  if (!(init_std > 0)) return bad("init_std", "must be positive");
  if (!(expert_init_spread >= 0 && expert_init_spread <= 1)) return bad("expert_init_spread", "must be in [0, 1]");
  if (router_dim < 0) return bad("router_dim", "must be >= 0 (0 = num_experts / 2)");
  if (soft_moe_slots <= 0 || (gating == Gating::kSoftMoe && (int64_t)soft_moe_slots * num_experts > 4096))
    return bad("soft_moe_slots", "must be positive, and under soft_moe num_experts * soft_moe_slots at most 4096");
  if (router_dim > 65536) return bad("router_dim", "must be at most 65536");
  if (!connectivity.empty() && static_cast<int>(connectivity.size()) != num_layers)
    return bad("connectivity", "needs one entry per layer (" + std::to_string(num_layers) +
                                   "), or a single value for all");
  return Status::ok();
}

const char* gating_name(Gating g) {
  switch (g) {
    case Gating::kSoftmaxTopK: return "softmax_topk";
    case Gating::kSigmoidTopK: return "sigmoid_topk";
    case Gating::kExpertChoice: return "expert_choice";
    case Gating::kGShardNoisyTopK: return "gshard_noisy_topk";
    case Gating::kXMoe: return "xmoe";
    case Gating::kSoftMoe: return "soft_moe";
  }
  return "?";
}

Expected<Gating> parse_gating(const std::string& s) {
  for (Gating g : {Gating::kSoftmaxTopK, Gating::kSigmoidTopK, Gating::kExpertChoice, Gating::kGShardNoisyTopK,
                   Gating::kXMoe, Gating::kSoftMoe})
    if (s == gating_name(g)) return g;
  return Status::invalid_argument("unknown gating '" + s +
                                  "' (expected softmax_topk, sigmoid_topk, expert_choice, gshard_noisy_topk, "
                                  "xmoe or soft_moe)");
}

const char* connectivity_name(Connectivity c) {
  switch (c) {
    case Connectivity::kRegular: return "regular";
    case Connectivity::kFarSkip: return "farskip";
    case Connectivity::kFarSkipAttention: return "farskip_attention";
    case Connectivity::kFarSkipMoe: return "farskip_moe";
  }
  return "?";
}

Expected<Connectivity> parse_connectivity(const std::string& s) {
  for (Connectivity c : {Connectivity::kRegular, Connectivity::kFarSkip,
                         Connectivity::kFarSkipAttention, Connectivity::kFarSkipMoe})
    if (s == connectivity_name(c)) return c;
  return Status::invalid_argument(
      "unknown connectivity '" + s +
      "' (expected regular, farskip, farskip_attention or farskip_moe)");
}

int expert_capacity(const ModelConfig& cfg, int tokens) {
  double factor = cfg.capacity_factor;
  if (factor <= 0) {
    if (cfg.gating != Gating::kExpertChoice) return tokens;  // dropless
    factor = 1.0;
  }
  double cap = std::ceil(factor * tokens * cfg.top_k / cfg.num_experts);
  return static_cast<int>(std::min<double>(cap, tokens));
}

}  // namespace xd
