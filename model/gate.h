// Gate: routes tokens to experts (FSMoE "Gate"). From router logits (N, E) it
// picks assignments (token, expert, combine weight) under the token-choice or
// expert-choice gating function and expert capacity, hands them to Order
// (model/order.h), and computes the router aux and z losses. The routers that
// make the logits (plain, noisy, cosine) live in model/router.h. Its
// backward turns d(weights) plus the aux/z loss terms into d(logits).
// Stateless apart from the cache it fills; one Gate per layer call, not shared.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_config.h"
#include "model/order.h"

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

template <typename T>
void gate_forward(DispatchPlan<T>* plan, GateCache<T>* cache, const T* logits,
                  const ModelConfig& cfg, int num_tokens);

// dlogits (N, E) is ACCUMULATED: from d(loss)/d(weight) per plan entry and the
// aux and z losses scaled by their coefficients times `loss_scale`.
template <typename T>
void gate_backward(T* dlogits, const std::vector<T>& dweight, const DispatchPlan<T>& plan,
                   const GateCache<T>& cache, const ModelConfig& cfg, double loss_scale);

}  // namespace xd
