// Order (FSMoE Sec. 3.1): the layout step between a router and the exchange.
// A router emits assignments in whatever order suits it; Order groups them by
// expert into a DispatchPlan, gathers the rows each assignment sends, and its
// reverse puts rows coming back where they belong. Each assignment names the
// row it sends (a row of the router's dispatch source: the token itself for
// token routers, a slot input for SoftMoE) apart from the token its output
// returns to, so a router with its own layout plugs in here and the exchange
// never changes. Plain functions on caller-owned buffers; no state.
#pragma once

#include <vector>

namespace xd {

// One routed row: `source_row` of the dispatch source goes to `expert`; its
// output comes back to `token` scaled by `weight`.
template <typename T>
struct RouteAssignment {
  int expert = 0;
  int source_row = 0;
  int token = 0;
  T weight = T(0);
};

// Assignments grouped by expert: expert e owns entries
// [expert_offsets[e], expert_offsets[e+1]), in the order the router emitted
// them within an expert.
template <typename T>
struct DispatchPlan {
  int num_tokens = 0, num_experts = 0;
  std::vector<int> expert_offsets;  // (E+1)
  std::vector<int> source_row;      // (A) row of the dispatch source each entry sends
  std::vector<int> token;           // (A) token each entry's output returns to
  std::vector<T> weight;            // (A) combine weight
  int dropped = 0;                  // assignments lost to capacity
  int count(int e) const { return expert_offsets[e + 1] - expert_offsets[e]; }
  int size() const { return static_cast<int>(token.size()); }
};

// Groups `assignments` by expert (stable) into `plan`; `dropped` is kept.
template <typename T>
void order_plan(DispatchPlan<T>* plan, const std::vector<RouteAssignment<T>>& assignments, int num_tokens,
                int num_experts);

// Order: out (|entries|, d) = the source rows of plan entries `entries`.
template <typename T>
void order_gather(std::vector<T>* out, const T* source, const DispatchPlan<T>& plan, const std::vector<int>& entries,
                  int d);

// Reverse of Order for gradients: dsource[source_row of entries[k]] += rows[k].
template <typename T>
void order_scatter_add(T* dsource, const T* rows, const DispatchPlan<T>& plan, const std::vector<int>& entries,
                       int d);

// Reverse of Order for outputs: out (N, d) = sum over entries a of
// weight[a] * rows[a] into row token[a]; rows are (A, d) in plan order.
template <typename T>
void order_combine(T* out, const T* rows, const DispatchPlan<T>& plan, int d);

}  // namespace xd
