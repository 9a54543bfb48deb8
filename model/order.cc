#include "model/order.h"

#include <algorithm>

#include "common/check.h"

namespace xd {

template <typename T>
void order_plan(DispatchPlan<T>* plan, const std::vector<RouteAssignment<T>>& assignments, int num_tokens,
                int num_experts) {
  plan->num_tokens = num_tokens;
  plan->num_experts = num_experts;
  plan->expert_offsets.assign(num_experts + 1, 0);
  for (const RouteAssignment<T>& a : assignments) {
    XD_CHECK(a.expert >= 0 && a.expert < num_experts);
    ++plan->expert_offsets[a.expert + 1];
  }
  for (int e = 0; e < num_experts; ++e) plan->expert_offsets[e + 1] += plan->expert_offsets[e];
  const size_t A = assignments.size();
  plan->source_row.resize(A);
  plan->token.resize(A);
  plan->weight.resize(A);
  std::vector<int> next(plan->expert_offsets.begin(), plan->expert_offsets.end() - 1);
  for (const RouteAssignment<T>& a : assignments) {
    const int at = next[a.expert]++;
    plan->source_row[at] = a.source_row;
    plan->token[at] = a.token;
    plan->weight[at] = a.weight;
  }
}

template <typename T>
void order_gather(std::vector<T>* out, const T* source, const DispatchPlan<T>& plan, const std::vector<int>& entries,
                  int d) {
  // Appended row by row into reserved space: no zero fill before the copy.
  out->clear();
  out->reserve(entries.size() * (size_t)d);
  for (const int a : entries) {
    const T* row = source + (size_t)plan.source_row[a] * d;
    out->insert(out->end(), row, row + d);
  }
}

template <typename T>
void order_scatter_add(T* dsource, const T* rows, const DispatchPlan<T>& plan, const std::vector<int>& entries,
                       int d) {
  for (size_t k = 0; k < entries.size(); ++k) {
    T* dst = dsource + (size_t)plan.source_row[entries[k]] * d;
    const T* src = rows + k * d;
    for (int j = 0; j < d; ++j) dst[j] += src[j];
  }
}

template <typename T>
void order_combine(T* out, const T* rows, const DispatchPlan<T>& plan, int d) {
  std::fill(out, out + (size_t)plan.num_tokens * d, T(0));
  for (int a = 0; a < plan.size(); ++a) {
    T* dst = out + (size_t)plan.token[a] * d;
    const T* src = rows + (size_t)a * d;
    const T w = plan.weight[a];
    for (int j = 0; j < d; ++j) dst[j] += w * src[j];
  }
}

#define XD_INSTANTIATE_ORDER(T)                                                                                \
  template void order_plan<T>(DispatchPlan<T>*, const std::vector<RouteAssignment<T>>&, int, int);                 \
  template void order_gather<T>(std::vector<T>*, const T*, const DispatchPlan<T>&, const std::vector<int>&,   \
                                int);                                                                          \
  template void order_scatter_add<T>(T*, const T*, const DispatchPlan<T>&, const std::vector<int>&, int);      \
  template void order_combine<T>(T*, const T*, const DispatchPlan<T>&, int);
XD_INSTANTIATE_ORDER(float)
XD_INSTANTIATE_ORDER(double)

}  // namespace xd
