// What MoeTransformer's forward keeps for its backward, and the test for
// replicas both schedules use (model/moe_transformer.cc: the forward,
// model/moe_transformer_backward.cc: the backward). Internal to the model.
#pragma once

#include <vector>

#include "model/expert_exchange.h"
#include "model/moe_transformer.h"

namespace xd {

template <typename T>
struct MoeTransformer<T>::LayerCache {
  std::vector<T> attn_in;            // (N, d) o_{k-1}, or p_{k-1} under FarSkip attention
  std::vector<T> norm1, rstd1;       // (N, d), (N)
  std::vector<T> q, k, v;            // post-RoPE, (N, H*hd), (N, KVH*hd) x2
  std::vector<T> probs;              // (B, H, T, T)
  std::vector<T> context;            // (N, H*hd)
  std::vector<T> attn_out;           // a_k (N, d)
  std::vector<T> moe_in;             // (N, d)
  std::vector<T> norm2, rstd2;
  std::vector<T> shared_out, routed_out;  // s_k, r_k (N, d)
  std::vector<T> partial;            // p_k = o_{k-1} + a_k + s_k: o_k before r_k arrives (N, d)
  MoeCache<T> moe;
};

namespace detail {

// Whether gathered experts (HybridEP replicas) are among those computed here.
template <typename T>
bool computes_replicas(const ExpertExchange<T>& exchange) {
  for (size_t j = 0; j < exchange.computed_experts().size(); ++j)
    if (exchange.is_replica(j)) return true;
  return false;
}

}  // namespace detail
}  // namespace xd
