// ModelConfig: the shape and the routing/connectivity choices of one MoE transformer.
// Plain data; validate() names the first offending field. The same struct is what
// config.json (HF Mixtral style) round-trips, see model/checkpoint.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace xd {

// Routing functions (FSMoE's Gate; docs/model.md). Values are stored in
// checkpoints by name; append only.
enum class Gating : int {
  kSoftmaxTopK = 0,
  kSigmoidTopK = 1,
  kExpertChoice = 2,
  kGShardNoisyTopK = 3,  // learned noise on the logits in training (Shazeer et al.)
  kXMoe = 4,             // cosine routing in a low-rank space (X-MoE)
  kSoftMoe = 5,          // slots of softly mixed tokens, causal (SoftMoE)
};

// Which inputs of layer k skip ahead (FarSkip-Collective Sec. 3; docs/model.md). kRegular is pre-norm.
enum class Connectivity : int {
  kRegular = 0,
  kFarSkip = 1,           // attention input partial, MoE input outdated
  kFarSkipAttention = 2,  // attention input partial only
  kFarSkipMoe = 3,        // MoE input outdated only
};
// Whether a layer's attention reads the partial p_{k-1} (FarSkip attention),
// and whether its MoE block reads the outdated o_{k-1} (FarSkip MoE).
inline bool farskip_attention(Connectivity c) {
  return c == Connectivity::kFarSkip || c == Connectivity::kFarSkipAttention;
}
inline bool farskip_moe(Connectivity c) { return c == Connectivity::kFarSkip || c == Connectivity::kFarSkipMoe; }

struct ModelConfig {
  int vocab_size = 256;
  int hidden_size = 64;          // d
  int num_layers = 2;
  int num_heads = 4;
  int num_kv_heads = 4;          // < num_heads: grouped KV heads
  int max_seq_len = 64;
  int num_experts = 4;           // E
  int top_k = 2;
  int expert_intermediate_size = 128;  // SwiGLU hidden of one routed expert
  int num_shared_experts = 0;
  int shared_intermediate_size = 128;
  Gating gating = Gating::kSoftmaxTopK;
  // Expert capacity = ceil(capacity_factor * tokens * top_k / E); 0 = dropless.
  // Expert-choice gating uses it too (0 there means factor 1).
  double capacity_factor = 0.0;
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.001;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  double init_std = 0.02;
  // 1: every routed expert starts from its own random draw. Below 1, the
  // experts of a layer start alike, as after sparse upcycling: one draw shared
  // by the layer's experts, plus this fraction of each expert's own
  // (w = std * (sqrt(1 - s^2) shared + s own), so the std stays init_std).
  double expert_init_spread = 1.0;
  std::vector<Connectivity> connectivity;  // one per layer; empty = all regular
  // X-MoE: dimension d_e of the routing space; 0 = num_experts / 2 (at least 1).
  int router_dim = 0;
  // SoftMoE: slots per expert (p); the layer has num_experts * p slots.
  int soft_moe_slots = 1;

  int head_dim() const { return hidden_size / num_heads; }
  int resolved_router_dim() const { return router_dim > 0 ? router_dim : std::max(1, num_experts / 2); }
  // Rows of gate.weight: experts, slots (SoftMoE) or routing dimensions (X-MoE).
  int router_rows() const {
    return gating == Gating::kSoftMoe ? num_experts * soft_moe_slots
                                      : gating == Gating::kXMoe ? resolved_router_dim() : num_experts;
  }
  // Routed rows per token that Dispatch moves and experts compute: k, or
  // every slot for SoftMoE (E * p).
  int routed_rows_per_token() const { return gating == Gating::kSoftMoe ? num_experts * soft_moe_slots : top_k; }
  Connectivity layer_connectivity(int layer) const {
    return connectivity.empty() ? Connectivity::kRegular : connectivity[layer];
  }
  Status validate() const;
};

const char* gating_name(Gating g);
Expected<Gating> parse_gating(const std::string& s);
const char* connectivity_name(Connectivity c);
Expected<Connectivity> parse_connectivity(const std::string& s);

// Capacity of one expert for `tokens` routed tokens under the config.
int expert_capacity(const ModelConfig& cfg, int tokens);

}  // namespace xd
