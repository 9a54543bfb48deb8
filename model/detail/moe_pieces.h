// Pieces of the MoE block's exchanges that both row layouts share: one row
// per expert (model/moe_layer.cc) and one per token and worker
// (model/detail/moe_grouped.cc). Plain functions on a layer's cache; the
// same contract as the functions of model/moe_layer.h.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "common/check.h"
#include "model/moe_layer.h"

namespace xd {
namespace detail {

// The exchange tags of a layer's chunk, and of the backward exchange that
// starts at forward chunk `first` (dims.backward_span() chunks).
inline ExchangeTag moe_tag(const MoeDims& dm, ExchangePhase phase, int chunk) {
  return ExchangeTag{dm.layer, static_cast<int>(phase), chunk};
}
inline ExchangeTag moe_backward_tag(const MoeDims& dm, ExchangePhase phase, int first) {
  return ExchangeTag{dm.layer, static_cast<int>(phase), first, dm.backward_span()};
}
// The first row of each expert's block, from the rows per expert.
inline std::vector<size_t> row_offsets(const std::vector<int>& counts) {
  std::vector<size_t> first(counts.size());
  size_t row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    first[j] = row;
    row += counts[j];
  }
  return first;
}

// Splits each expert's rows (offsets: E+1, plan entries or groups by expert)
// into `r` contiguous parts; chunk i takes the i-th part of every expert, so
// each chunk is grouped by expert too.
template <typename T>
void split_into_chunks(MoeCache<T>* c, int r, const std::vector<int>& offsets) {
  const int E = static_cast<int>(offsets.size()) - 1;
  c->chunks.resize(r);
  for (int i = 0; i < r; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    ch.plan_rows.clear();
    ch.counts.assign(E, 0);
    for (int e = 0; e < E; ++e) {
      const int n = offsets[e + 1] - offsets[e], first = offsets[e];
      const int begin = first + (int)((int64_t)n * i / r), end = first + (int)((int64_t)n * (i + 1) / r);
      for (int a = begin; a < end; ++a) ch.plan_rows.push_back(a);
      ch.counts[e] = end - begin;
    }
  }
}

// Runs each computed expert on its block of ch->expert_in (expert_counts
// rows each) into out: the owned experts first, while the replicas'
// weights may still be arriving, then before_replicas and the replicas.
template <typename T>
void experts_forward(T* out, MoeChunk<T>* ch, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                     const MoeDims& dm) {
  const size_t computed = ch->expert_counts.size(), d = dm.hidden;
  ch->expert_cache.resize(computed);
  const std::vector<size_t> first_row = row_offsets(ch->expert_counts);
  for (bool replicas : {false, true}) {
    if (replicas) exchange->before_replicas(dm.layer);
    for (size_t j = 0; j < computed; ++j) {
      if (exchange->is_replica(j) != replicas) continue;
      swiglu_expert_forward(out + first_row[j] * d, &ch->expert_cache[j], ch->expert_in.data() + first_row[j] * d,
                            w.computed[j], ch->expert_counts[j], (int)d, dm.expert_ff);
    }
  }
}

// Finishes every chunk's Combine into `rows` (count x d): each chunk's rows
// land at its plan_rows (plan entries, or groups).
template <typename T>
void finish_combines(std::vector<T>* rows, size_t count, const MoeCache<T>& c, ExpertExchange<T>* exchange,
                     const MoeDims& dm) {
  const size_t d = dm.hidden;
  rows->resize(count * d);
  std::vector<T> back;
  for (int i = 0; i < dm.chunks; ++i) {
    const MoeChunk<T>& ch = c.chunks[i];
    exchange->finish_to_sources(moe_tag(dm, ExchangePhase::kCombine, i), &back);
    XD_CHECK(back.size() == ch.plan_rows.size() * d);
    for (size_t k = 0; k < ch.plan_rows.size(); ++k)
      std::memcpy(rows->data() + (size_t)ch.plan_rows[k] * d, back.data() + k * d, sizeof(T) * d);
  }
}

// A backward exchange's rows are grouped by computed expert, and within an
// expert by chunk: chunk i's block of expert j starts at row at[i - first][j]
// (at: span x computed). rows_of(i) gives chunk i's rows per computed
// expert; `counts` are the exchange's, which the blocks must add up to.
// Returns the exchange's rows.
template <typename F>
size_t backward_exchange_layout(std::vector<std::vector<size_t>>* at, const std::vector<int>& counts, int first,
                                int span, F rows_of) {
  const size_t computed = counts.size();
  at->assign(span, std::vector<size_t>(computed));
  size_t row = 0;
  for (size_t j = 0; j < computed; ++j) {
    const size_t expert_first = row;
    for (int i = first; i < first + span; ++i) {
      const std::vector<int>& rows = rows_of(i);
      XD_CHECK(rows.size() == computed);
      (*at)[i - first][j] = row;
      row += rows[j];
    }
    XD_CHECK(row - expert_first == (size_t)counts[j]);
  }
  return row;
}

// The weight gradients of one backward exchange (forward chunks first ..
// first + span - 1), replicas' first, each run now or appended to
// `deferred` (owned experts) or `deferred_replicas`, as moe_experts_backward
// says; then, after the last chunk's replicas, replicas_backward_done.
// weights_of(chunk, computed expert) gives one expert's computation.
template <typename T>
void schedule_weight_gradients(ExpertExchange<T>* exchange, const MoeDims& dm, int first, size_t computed,
                               const std::function<std::function<void()>(int, size_t)>& weights_of,
                               std::vector<std::function<void()>>* deferred,
                               std::vector<std::function<void()>>* deferred_replicas) {
  const int span = dm.backward_span();
  for (bool replicas : {true, false}) {
    for (int i = first; i < first + span; ++i)
      for (size_t j = 0; j < computed; ++j) {
        if (exchange->is_replica(j) != replicas) continue;
        std::function<void()> weights = weights_of(i, j);
        if (deferred && !replicas) deferred->push_back(std::move(weights));
        else if (deferred_replicas && replicas) deferred_replicas->push_back(std::move(weights));
        else weights();
      }
    if (replicas && first + span == dm.chunks) {
      if (deferred_replicas)
        deferred_replicas->push_back([exchange, layer = dm.layer] { exchange->replicas_backward_done(layer); });
      else
        exchange->replicas_backward_done(dm.layer);
    }
  }
}

}  // namespace detail
}  // namespace xd
