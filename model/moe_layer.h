// The MoE block of one layer: Gate -> Order (dispatch plan) -> Dispatch ->
// Expert -> Combine, plus shared experts that see every token. Dispatch and
// Combine go through an ExpertExchange, so the same math runs in one process
// or across workers. Routed and shared outputs are returned separately because
// FarSkip connectivity treats them differently. Not thread-safe: one cache per
// layer and micro-batch.
#pragma once

#include <vector>

#include "model/expert_exchange.h"
#include "model/gate.h"
#include "model/model_config.h"
#include "model/swiglu_expert.h"

namespace xd {

template <typename T>
struct MoeWeights {
  const T* router;  // (E, d)
  T* drouter;       // (E, d)
  std::vector<ExpertParams<T>> computed;  // one per exchange->computed_experts()
  std::vector<ExpertParams<T>> shared;    // one per shared expert
};

template <typename T>
struct MoeCache {
  std::vector<T> logits;            // (N, E)
  GateCache<T> gate;
  DispatchPlan<T> plan;
  std::vector<int> counts;          // (E) plan rows per global expert
  std::vector<T> expert_in;         // rows this worker computes, grouped by expert
  std::vector<int> expert_counts;   // per computed expert
  std::vector<ExpertCache<T>> expert_cache;
  std::vector<T> routed_rows;       // (A, d) expert outputs back at the source
  std::vector<ExpertCache<T>> shared_cache;
  std::vector<T> shared_scratch;    // (N, d)
};

struct MoeDims {
  int num_tokens, hidden, expert_ff, shared_ff, layer;
};

// shared_out and routed_out (N, d) are overwritten.
template <typename T>
void moe_forward(T* shared_out, T* routed_out, MoeCache<T>* cache, const T* xn,
                 const MoeWeights<T>& w, ExpertExchange<T>* exchange, const ModelConfig& cfg,
                 const MoeDims& dims);

// dxn (N, d) is accumulated; dshared/drouted are the gradients of the outputs.
// loss_scale multiplies the router aux/z loss gradients (1 for a plain step).
template <typename T>
void moe_backward(T* dxn, const T* dshared, const T* drouted, MoeCache<T>* cache, const T* xn,
                  const MoeWeights<T>& w, ExpertExchange<T>* exchange, const ModelConfig& cfg,
                  const MoeDims& dims, double loss_scale);

}  // namespace xd
