// The MoE block of one layer: Router/Gate -> Order (dispatch plan) -> Dispatch ->
// Expert -> Combine, plus shared experts that see every token. Dispatch and
// Combine go through an ExpertExchange, so the same math runs in one process
// or across workers. Routed and shared outputs are returned separately because
// FarSkip connectivity treats them differently.
//
// The block comes in pieces so a schedule can compute while its exchanges
// move (docs/overlap.md): the route starts Dispatch, the experts pass finishes
// it chunk by chunk and starts Combine, the combine-finish pass waits for it.
// With pipeline degree r the plan rows of every expert are split into r
// chunks, each its own Dispatch/Combine, so experts compute on chunk i while
// chunk i+1 is still moving (FSMoE Sec. 4). moe_forward runs the forward
// pieces back to back; MoeTransformer runs the backward ones in its schedule.
// With MoeDims::once_per_worker a token routed to several experts of one
// worker travels there once ("grouped" rows, model/detail/moe_grouped.h):
// that worker sums the experts' weighted outputs and, in the backward,
// returns each expert's combine-weight gradient beside the row's. Not
// thread-safe: one cache per layer and micro-batch.
#pragma once

#include <functional>
#include <vector>

#include "model/expert_exchange.h"
#include "model/router.h"
#include "model/model_config.h"
#include "model/swiglu_expert.h"

namespace xd {

template <typename T>
struct MoeWeights {
  RouterWeights<T> router;
  std::vector<ExpertParams<T>> computed;  // one per exchange->computed_experts()
  std::vector<ExpertParams<T>> shared;    // one per shared expert
};

// One pipeline chunk of a layer's routed rows.
template <typename T>
struct MoeChunk {
  std::vector<int> plan_rows;       // plan indices in send order (grouped by expert)
  std::vector<int> counts;          // (E) rows per global expert
  std::vector<T> expert_in;         // rows this worker computes, grouped by computed expert
  std::vector<int> expert_counts;   // per computed expert
  std::vector<ExpertCache<T>> expert_cache;  // per computed expert
  std::vector<T> expert_dout;       // backward: output grads at the experts
  // Grouped rows (once_per_worker). At the source plan_rows holds group
  // indices. At the experts: the rows received per computed expert (their
  // group's first), and per expert_in row the received row, its place in
  // that row's group, its combine weight and the expert's output.
  std::vector<int> recv_counts;
  std::vector<int> entry_row, entry_slot;
  std::vector<T> entry_weight;
  std::vector<T> expert_out;
};

template <typename T>
struct MoeCache {
  RouterCache<T> router;
  DispatchPlan<T> plan;
  std::vector<MoeChunk<T>> chunks;  // r of them
  std::vector<T> routed_rows;       // (A, d) expert outputs back at the source, plan order; grouped: (U, d) by group
  std::vector<T> dweight;           // (A) backward: d loss / d combine weight
  std::vector<T> dsource;           // SoftMoE backward: d loss / d slot inputs
  std::vector<ExpertCache<T>> shared_cache;
  std::vector<T> shared_scratch;    // (N, d)
  // Grouped rows (once_per_worker): plan entries sending one source row to
  // one worker form a group of at most group_slots entries (the same on
  // every worker: it sets the rows' width); group u's entries are
  // group_entry[group_first[u] .. group_first[u+1]), expert ascending, and
  // groups are numbered by their first entry's expert (group_offsets, E+1).
  int group_slots = 0;
  std::vector<int> group_first, group_entry, group_offsets;
  double loss_scale = 1;            // the router's backward waits for the experts' d(weight)
};

struct MoeDims {
  int num_tokens, hidden, expert_ff, shared_ff, layer;
  int chunks = 1;   // pipeline degree r
  // The backward's degree, a divisor of `chunks` (0: the same): each of its
  // exchanges carries chunks / backward_chunks forward chunks, whose math
  // stays chunk by chunk, so the degree changes no result.
  int backward_chunks = 0;
  int backward_span() const { return backward_chunks > 0 ? chunks / backward_chunks : 1; }
  int seq_len = 0;  // 0 = num_tokens (one sequence)
  // A token goes once to each worker that computes some of its experts
  // (docs/overlap.md, "A token once per worker"). Token routers only.
  bool once_per_worker = false;
  RoutingContext routing = {};
  RouterCall router_call() const {
    return RouterCall{num_tokens, seq_len > 0 ? seq_len : num_tokens, layer, routing};
  }
};

// --- Forward, in schedule order ---
// Router and gate on xn (N, d); starts the Dispatch of every chunk.
template <typename T>
void moe_route_forward(MoeCache<T>* cache, const T* xn, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                       const ModelConfig& cfg, const MoeDims& dims);
// Per chunk: finishes its Dispatch, runs the experts, starts its Combine.
template <typename T>
void moe_experts_forward(MoeCache<T>* cache, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                         const MoeDims& dims);
// shared_out (N, d) is overwritten.
template <typename T>
void moe_shared_forward(T* shared_out, MoeCache<T>* cache, const T* xn, const MoeWeights<T>& w, const MoeDims& dims);
// Finishes every chunk's Combine; routed_out (N, d) is overwritten.
template <typename T>
void moe_combine_finish(T* routed_out, MoeCache<T>* cache, ExpertExchange<T>* exchange, const MoeDims& dims);
// Peeks, never blocks: whether chunk 0's Dispatch / every chunk's Combine of
// dims.layer has landed, so the caller can do independent work first.
template <typename T>
bool moe_dispatch_landed(const ExpertExchange<T>& exchange, const MoeDims& dims);
template <typename T>
bool moe_combine_landed(const ExpertExchange<T>& exchange, const MoeDims& dims);
template <typename T>
bool moe_combine_backward_landed(const ExpertExchange<T>& exchange, const MoeDims& dims);  // the first one

// --- Backward, in schedule order; dxn (N, d) accumulates ---
// d(weight) locally; starts the backward of Combine (output grads to the experts).
template <typename T>
void moe_combine_backward_start(MoeCache<T>* cache, const T* drouted, ExpertExchange<T>* exchange,
                                const MoeDims& dims);
// Router and gate backward; needs moe_combine_backward_start first.
// loss_scale multiplies the router's logit gradients, aux and z terms included
// (1 for a plain step).
template <typename T>
void moe_router_backward(T* dxn, MoeCache<T>* cache, const T* xn, const MoeWeights<T>& w, const ModelConfig& cfg,
                         const MoeDims& dims, double loss_scale);
// Per backward exchange (dims.backward_span() chunks each): finishes its
// Combine backward, computes its chunks' input gradients, starts the backward
// of Dispatch, then the weight gradients (which overlap it), replicas' first.
// With `deferred`, the weight gradients of the experts this worker owns are
// appended there instead, to run (in order) before the next forward: nothing
// waits for them but the optimizer. With `deferred_replicas`, so are the
// replicas' (their exchange's replicas_backward_done last), to run before
// the owned ones.
template <typename T>
void moe_experts_backward(MoeCache<T>* cache, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                          const MoeDims& dims, std::vector<std::function<void()>>* deferred = nullptr,
                          std::vector<std::function<void()>>* deferred_replicas = nullptr);
template <typename T>
void moe_shared_backward(T* dxn, const T* dshared, MoeCache<T>* cache, const T* xn, const MoeWeights<T>& w,
                         const MoeDims& dims);
// Finishes every chunk's Dispatch backward and adds the rows into dxn
// (SoftMoE: into the slot inputs' gradient, then through the router).
template <typename T>
void moe_dispatch_backward_finish(T* dxn, MoeCache<T>* cache, const T* xn, const MoeWeights<T>& w,
                                  ExpertExchange<T>* exchange, const ModelConfig& cfg, const MoeDims& dims);

// The whole forward, pieces back to back.
template <typename T>
void moe_forward(T* shared_out, T* routed_out, MoeCache<T>* cache, const T* xn,
                 const MoeWeights<T>& w, ExpertExchange<T>* exchange, const ModelConfig& cfg,
                 const MoeDims& dims);

}  // namespace xd
