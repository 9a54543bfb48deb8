// Grouped rows: the MoE block's exchanges when a token goes once to each
// worker that computes some of its experts (MoeDims::once_per_worker).
// The plan entries that send one source row to one destination
// (ExpertExchange::destination_of) form a group; the group travels as one
// row, filed under its first (lowest) expert, so the exchange routes it like
// any row of that expert. Row layouts, d = hidden, K = group_slots:
//   Dispatch:           [x (d) | experts of slots 1..K-1 | weights of slots 0..K-1]
//                       (an absent slot: expert -1, weight 0)
//   Combine:            [sum over the group's slots of weight * expert output (d)]
//   Combine backward:   [d output of the token (d)]
//   Dispatch backward:  [sum of the slots' input gradients (d) | d weight of slots 0..K-1]
// So the receiving worker sums the group's weighted outputs, scales the
// output gradient per expert and computes each combine weight's gradient
// (its output . the token's output gradient), which the source's router
// backward needs; that backward therefore runs once the backward of
// Dispatch has landed. The extra columns are exact only through lossless
// token codecs. Each worker's rows are summed expert by expert in ascending
// order, as one process sums them. Called by moe_layer.cc only; the same
// contract as its functions.
#pragma once

#include <functional>
#include <vector>

#include "model/detail/moe_pieces.h"
#include "model/moe_layer.h"

namespace xd {
namespace detail {

// K: the most entries one group can hold. Every worker computes as many
// experts, so every worker agrees on it.
int group_slots(const ModelConfig& cfg, size_t computed_experts);

template <typename T>
void grouped_route(MoeCache<T>* c, const T* source, ExpertExchange<T>* exchange, const ModelConfig& cfg,
                   const MoeDims& dims);
template <typename T>
void grouped_experts_forward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                             const MoeDims& dims);
template <typename T>
void grouped_combine_finish(T* routed_out, MoeCache<T>* c, ExpertExchange<T>* exchange, const MoeDims& dims);
template <typename T>
void grouped_combine_backward_start(MoeCache<T>* c, const T* drouted, ExpertExchange<T>* exchange,
                                    const MoeDims& dims);
template <typename T>
void grouped_experts_backward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                              const MoeDims& dims, std::vector<std::function<void()>>* deferred,
                              std::vector<std::function<void()>>* deferred_replicas);
// Adds the input gradients into dxn, then runs the router's backward.
template <typename T>
void grouped_dispatch_backward_finish(T* dxn, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w,
                                      ExpertExchange<T>* exchange, const ModelConfig& cfg, const MoeDims& dims);

}  // namespace detail
}  // namespace xd
