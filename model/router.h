// Router: the first piece of the MoE block. From the normed tokens it computes
// the routing scores of the configured gating function, hands the chosen
// (row, expert, weight) assignments to Order as a DispatchPlan, and names the
// matrix whose rows the plan sends (the dispatch source):
//   * softmax / sigmoid top-k and expert choice: logits = x Wᵀ, then the Gate;
//   * GShard noisy top-k: logits plus learned, seeded Gaussian noise in training;
//   * X-MoE: cosine of a low-rank projection with expert embeddings over a
//     learned temperature;
//   * SoftMoE: every expert holds slots whose inputs are causal soft mixes of
//     the sequence's tokens; the plan sends slot inputs, not tokens.
// Forward and backward are written by hand (docs/model.md has the equations).
// The backward comes in two parts because SoftMoE's dispatch gradient only
// arrives after the backward of Dispatch: router_backward_combine needs the
// combine-weight gradients, router_backward_dispatch the dispatch-source
// gradients (token routers need no second part). Stateless apart from the
// cache; one cache per layer and micro-batch, not thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "model/gate.h"
#include "model/model_config.h"
#include "model/order.h"

namespace xd {

// What makes the GShard noise reproducible: the noise of a token depends only
// on (seed, step, layer, global token index), so a worker holding rows
// first_row.. of the global batch draws what one process draws for them.
struct RoutingContext {
  bool training = false;   // noise only in training, none at evaluation
  uint64_t seed = 0;
  uint64_t step = 0;       // batch index
  int64_t first_row = 0;   // global index of the call's first sequence
};

template <typename T>
struct RouterWeights {
  const T* gate = nullptr;       // (E, d); (E*p, d) SoftMoE; (d_e, d) X-MoE
  T* dgate = nullptr;
  const T* noise = nullptr;      // (E, d) GShard
  T* dnoise = nullptr;
  const T* experts = nullptr;    // (E, d_e) X-MoE
  T* dexperts = nullptr;
  const T* log_scale = nullptr;  // (1) X-MoE, log(1 / temperature)
  T* dlog_scale = nullptr;
};

struct RouterCall {
  int num_tokens = 0;  // N = batch * seq_len
  int seq_len = 0;     // T (SoftMoE mixes within a sequence)
  int layer = 0;
  RoutingContext context;
};

template <typename T>
struct RouterCache {
  GateCache<T> gate;          // scores, aux and z losses (SoftMoE: z only)
  std::vector<T> logits;      // (N, E) what the Gate saw; SoftMoE (N, S)
  bool noisy = false;         // GShard: noise was added
  std::vector<T> noise_raw;   // (N, E) x W_noiseᵀ
  std::vector<T> noise;       // (N, E) standard normal draws
  std::vector<T> proj;        // X-MoE (N, d_e) unit rows of x W_pᵀ
  std::vector<T> proj_norm;   // (N)
  std::vector<T> expert_unit; // (E, d_e)
  std::vector<T> expert_norm; // (E)
  std::vector<T> cosine;      // (N, E)
  std::vector<T> combine;     // SoftMoE (N, S) combine weights
  std::vector<double> slot_lse;  // SoftMoE (N) log-sum-exp of each row of logits (z-loss)
  std::vector<T> dispatch;    // SoftMoE (B, S, T, T) causal dispatch weights
  std::vector<T> slot_inputs; // SoftMoE (N*S, d), row n*S + s
};

// True when the plan sends rows other than the tokens (SoftMoE).
bool router_mixes_tokens(const ModelConfig& cfg);

template <typename T>
void router_forward(RouterCache<T>* cache, DispatchPlan<T>* plan, const T* xn, const RouterWeights<T>& w,
                    const ModelConfig& cfg, const RouterCall& call);

// The rows the plan's source_row indexes: xn, or SoftMoE's slot inputs.
template <typename T>
const T* router_source(const RouterCache<T>& cache, const T* xn, const ModelConfig& cfg);

// dxn (N, d) and the weight gradients ACCUMULATE. dweight (A) is d loss / d
// combine weight per plan entry; the aux and z terms enter scaled by their
// coefficients, everything times loss_scale.
template <typename T>
void router_backward_combine(T* dxn, const RouterWeights<T>& w, const RouterCache<T>& cache,
                             const DispatchPlan<T>& plan, const std::vector<T>& dweight, const T* xn,
                             const ModelConfig& cfg, const RouterCall& call, double loss_scale);

// SoftMoE only: dsource (N*S, d) is d loss / d slot inputs; it already carries
// any loss scale (it comes back from the experts), so none is applied here.
template <typename T>
void router_backward_dispatch(T* dxn, const RouterWeights<T>& w, const RouterCache<T>& cache, const T* dsource,
                              const T* xn, const ModelConfig& cfg, const RouterCall& call);

// The GShard noise of tokens global_token .. global_token + n - 1 at `layer`:
// eps (n, E), each row E standard normals in expert order.
void routing_noise(double* eps, const RoutingContext& ctx, int layer, int64_t global_token, int n, int num_experts);

}  // namespace xd
