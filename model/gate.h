// Gate: routes tokens to experts (FSMoE "Gate"). From router logits (N, E) it
// picks assignments (token, expert, combine weight) under the configured gating
// function and expert capacity, and computes the router aux and z losses. Its
// backward turns d(weights) plus the aux/z loss terms into d(logits).
// Stateless apart from the cache it fills; one Gate per layer call, not shared.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_config.h"

namespace xd {

template <typename T>
struct GateCache {
  int num_tokens = 0;
  std::vector<T> scores;     // (N, E) softmax probs, or sigmoid scores
  std::vector<T> logits;     // (N, E) copy, for the z-loss backward
  std::vector<int> chosen;   // (N, k) token-choice experts (before capacity drops)
  std::vector<double> norm;  // (N) sum of chosen scores (token-choice)
  std::vector<double> balance_prob;  // (E) P_e of the aux loss
  std::vector<double> balance_frac;  // (E) f_e of the aux loss
  double aux_loss = 0, z_loss = 0;
};

// Assignments grouped by expert (FSMoE "Order"): expert e owns entries
// [expert_offsets[e], expert_offsets[e+1]), tokens ascending within an expert.
template <typename T>
struct DispatchPlan {
  int num_tokens = 0, num_experts = 0;
  std::vector<int> expert_offsets;  // (E+1)
  std::vector<int> token;           // (A) source token of each assignment
  std::vector<T> weight;            // (A) combine weight
  int dropped = 0;                  // assignments lost to capacity
  int count(int e) const { return expert_offsets[e + 1] - expert_offsets[e]; }
  int size() const { return static_cast<int>(token.size()); }
};

template <typename T>
void gate_forward(DispatchPlan<T>* plan, GateCache<T>* cache, const T* logits,
                  const ModelConfig& cfg, int num_tokens);

// dlogits (N, E) is ACCUMULATED: from d(loss)/d(weight) per plan entry and the
// aux and z losses scaled by their coefficients times `loss_scale`.
template <typename T>
void gate_backward(T* dlogits, const std::vector<T>& dweight, const DispatchPlan<T>& plan,
                   const GateCache<T>& cache, const ModelConfig& cfg, double loss_scale);

}  // namespace xd
