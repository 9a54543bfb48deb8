#include "model/detail/moe_grouped.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"

namespace xd {
namespace detail {

int group_slots(const ModelConfig& cfg, size_t computed_experts) {
  // Expert choice may pick a token for any number of experts.
  const int per_token = cfg.gating == Gating::kExpertChoice ? cfg.num_experts : cfg.routed_rows_per_token();
  return std::max(1, std::min(per_token, static_cast<int>(computed_experts)));
}

namespace {

template <typename T>
int group_token(const MoeCache<T>& c, int u) {
  return c.plan.token[c.group_entry[c.group_first[u]]];
}

// Per received row of a chunk (in its exchange's layout, grouped by the
// computed expert its group is filed under), that expert's index.
std::vector<int> row_experts(const std::vector<int>& recv_counts) {
  std::vector<int> expert;
  for (size_t j = 0; j < recv_counts.size(); ++j) expert.insert(expert.end(), recv_counts[j], (int)j);
  return expert;
}

}  // namespace

template <typename T>
void grouped_route(MoeCache<T>* c, const T* source, ExpertExchange<T>* exchange, const ModelConfig& cfg,
                   const MoeDims& dm) {
  XD_CHECK_MSG(!router_mixes_tokens(cfg), "grouped rows need a router whose rows are its tokens");
  const DispatchPlan<T>& plan = c->plan;
  const int E = plan.num_experts, d = dm.hidden, A = plan.size();
  const int K = c->group_slots = group_slots(cfg, exchange->computed_experts().size());
  // Plan entries come expert by expert, so a group is numbered when its
  // lowest expert's entry comes: groups are in the order of their first
  // expert, and each group's entries in expert order.
  // The layer's destinations, numbered 0..D-1 (at most E), so that the
  // group of (source row, destination) is a flat lookup.
  std::vector<int> destination(E), destinations;
  for (int e = 0; e < E; ++e) {
    const int worker = exchange->destination_of(e);
    auto at = std::find(destinations.begin(), destinations.end(), worker);
    destination[e] = static_cast<int>(at - destinations.begin());
    if (at == destinations.end()) destinations.push_back(worker);
  }
  const size_t D = destinations.size();
  std::vector<int> entry_expert(A), entry_group(A), size, group_at((size_t)plan.num_tokens * D, -1);
  c->group_offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e)
    for (int a = plan.expert_offsets[e]; a < plan.expert_offsets[e + 1]; ++a) {
      entry_expert[a] = e;
      XD_CHECK(plan.source_row[a] < plan.num_tokens);
      int& group = group_at[(size_t)plan.source_row[a] * D + destination[e]];
      if (group < 0) {
        group = static_cast<int>(size.size());
        size.push_back(0);
        c->group_offsets[e + 1]++;
      }
      entry_group[a] = group;
      XD_CHECK_MSG(++size[group] <= K, "a group holds more entries than its rows have slots");
    }
  for (int e = 0; e < E; ++e) c->group_offsets[e + 1] += c->group_offsets[e];
  const int U = static_cast<int>(size.size());
  c->group_first.assign(U + 1, 0);
  for (int u = 0; u < U; ++u) c->group_first[u + 1] = c->group_first[u] + size[u];
  c->group_entry.resize(A);
  std::vector<int> fill(c->group_first.begin(), c->group_first.end() - 1);
  for (int a = 0; a < A; ++a) c->group_entry[fill[entry_group[a]]++] = a;

  split_into_chunks(c, dm.chunks, c->group_offsets);
  const int width = d + 2 * K - 1;
  for (int i = 0; i < dm.chunks; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    std::vector<T> send((size_t)ch.plan_rows.size() * width);
    T* row = send.data();
    for (const int u : ch.plan_rows) {
      const int* entry = c->group_entry.data() + c->group_first[u];
      const int n = c->group_first[u + 1] - c->group_first[u];
      XD_CHECK(plan.token[entry[0]] == plan.source_row[entry[0]]);
      std::memcpy(row, source + (size_t)plan.source_row[entry[0]] * d, sizeof(T) * d);
      for (int s = 1; s < K; ++s) row[d + s - 1] = s < n ? T(entry_expert[entry[s]]) : T(-1);
      for (int s = 0; s < K; ++s) row[d + K - 1 + s] = s < n ? plan.weight[entry[s]] : T(0);
      row += width;
    }
    exchange->start_to_experts(moe_tag(dm, ExchangePhase::kDispatch, i), std::move(send), ch.counts, width);
  }
}

template <typename T>
void grouped_experts_forward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                             const MoeDims& dm) {
  const int d = dm.hidden, K = c->group_slots, width = d + 2 * K - 1;
  const std::vector<int>& computed = exchange->computed_experts();
  const size_t C = computed.size();
  XD_CHECK(w.computed.size() == C);
  std::vector<int> index_of(c->plan.num_experts, -1);
  for (size_t j = 0; j < C; ++j) index_of[computed[j]] = (int)j;
  std::vector<T> recv;
  for (int i = 0; i < dm.chunks; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    exchange->finish_to_experts(moe_tag(dm, ExchangePhase::kDispatch, i), &recv, &ch.recv_counts);
    XD_CHECK(ch.recv_counts.size() == C);
    const std::vector<int> filed_under = row_experts(ch.recv_counts);
    const size_t R = filed_under.size();
    XD_CHECK(recv.size() == R * width);
    // Each (row, slot) to its expert, expert by expert, rows in order.
    ch.expert_counts.assign(C, 0);
    std::vector<std::pair<int, int>> slot_expert;  // (row * K + slot, expert index), rows in order
    for (size_t t = 0; t < R; ++t) {
      const T* meta = recv.data() + t * width + d;
      const T* weight = meta + K - 1;
      // The source's layout exactly (grouped_route): ids ascending above the
      // expert the row is filed under, then only absent slots (-1, weight 0).
      // Checked before any cast: the ids came over the wire.
      int previous = computed[filed_under[t]], n = 1;
      while (n < K && meta[n - 1] >= 0) {
        const T id = meta[n - 1];
        XD_CHECK_MSG(id < c->plan.num_experts && id == std::floor(id) && id > previous,
                     "a grouped row's experts are not ascending expert ids");
        previous = static_cast<int>(id);
        XD_CHECK_MSG(index_of[previous] >= 0, "a grouped row names an expert not computed here");
        ++n;
      }
      for (int s = n; s < K; ++s)
        XD_CHECK_MSG(meta[s - 1] == T(-1) && weight[s] == T(0), "a grouped row's absent slot is not empty");
      for (int s = 0; s < n; ++s) {
        const int e = s == 0 ? computed[filed_under[t]] : static_cast<int>(meta[s - 1]);
        slot_expert.push_back({(int)(t * K + s), index_of[e]});
        ch.expert_counts[index_of[e]]++;
      }
    }
    // Expert by expert, rows in order within one: each to its expert's next place.
    const size_t M = slot_expert.size();
    std::vector<size_t> next = row_offsets(ch.expert_counts);
    ch.expert_in.resize(M * d);
    ch.entry_row.resize(M);
    ch.entry_slot.resize(M);
    ch.entry_weight.resize(M);
    for (const auto& [row_slot, expert] : slot_expert) {
      const size_t m = next[expert]++;
      const int t = row_slot / K, s = row_slot % K;
      ch.entry_row[m] = t;
      ch.entry_slot[m] = s;
      ch.entry_weight[m] = recv[(size_t)t * width + d + K - 1 + s];
      std::memcpy(ch.expert_in.data() + m * d, recv.data() + (size_t)t * width, sizeof(T) * d);
    }
    ch.expert_out.resize(M * d);
    experts_forward(ch.expert_out.data(), &ch, w, exchange, dm);
    // Expert by expert in ascending order: each row's slots in their order.
    std::vector<T> out(R * d, T(0));
    for (size_t m = 0; m < M; ++m) {
      T* dst = out.data() + (size_t)ch.entry_row[m] * d;
      const T* y = ch.expert_out.data() + m * d;
      const T g = ch.entry_weight[m];
      for (int k = 0; k < d; ++k) dst[k] += g * y[k];
    }
    exchange->start_to_sources(moe_tag(dm, ExchangePhase::kCombine, i), std::move(out), d);
  }
}

template <typename T>
void grouped_combine_finish(T* routed_out, MoeCache<T>* c, ExpertExchange<T>* exchange, const MoeDims& dm) {
  const int d = dm.hidden;
  const int U = static_cast<int>(c->group_first.size()) - 1;
  finish_combines(&c->routed_rows, U, *c, exchange, dm);
  std::fill(routed_out, routed_out + (size_t)c->plan.num_tokens * d, T(0));
  for (int u = 0; u < U; ++u) {
    T* dst = routed_out + (size_t)group_token(*c, u) * d;
    const T* src = c->routed_rows.data() + (size_t)u * d;
    for (int k = 0; k < d; ++k) dst[k] += src[k];
  }
}

template <typename T>
void grouped_combine_backward_start(MoeCache<T>* c, const T* drouted, ExpertExchange<T>* exchange,
                                    const MoeDims& dm) {
  const int d = dm.hidden, span = dm.backward_span();
  XD_CHECK(span >= 1 && dm.chunks % span == 0);
  c->dweight.assign(c->plan.size(), T(0));
  for (int first = 0; first < dm.chunks; first += span) {
    std::vector<int> counts;
    std::vector<T> send;
    for (int i = first; i < first + span; ++i) {
      const MoeChunk<T>& ch = c->chunks[i];
      counts.insert(counts.end(), ch.counts.begin(), ch.counts.end());
      for (const int u : ch.plan_rows) {
        const T* g = drouted + (size_t)group_token(*c, u) * d;
        send.insert(send.end(), g, g + d);
      }
    }
    exchange->start_to_experts(moe_backward_tag(dm, ExchangePhase::kCombineBackward, first), std::move(send),
                               counts, d);
  }
}

template <typename T>
void grouped_experts_backward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                              const MoeDims& dm, std::vector<std::function<void()>>* deferred,
                              std::vector<std::function<void()>>* deferred_replicas) {
  const int d = dm.hidden, K = c->group_slots, span = dm.backward_span(), width = d + K;
  std::vector<T> dy;
  for (int first = 0; first < dm.chunks; first += span) {
    // The exchange's rows: by computed expert, within one by chunk. Chunk
    // i's received row t sits at at[i - first][j] + t - recv_at[i - first][j]
    // there, j the expert it is filed under.
    std::vector<int> counts;
    exchange->finish_to_experts(moe_backward_tag(dm, ExchangePhase::kCombineBackward, first), &dy, &counts);
    const size_t C = counts.size();
    std::vector<std::vector<size_t>> at, recv_at(span);
    const size_t rows = backward_exchange_layout(
        &at, counts, first, span, [c](int i) -> const std::vector<int>& { return c->chunks[i].recv_counts; });
    XD_CHECK(dy.size() == rows * d);
    std::vector<T> back(rows * width, T(0));
    for (int i = first; i < first + span; ++i) {
      MoeChunk<T>& ch = c->chunks[i];
      recv_at[i - first] = row_offsets(ch.recv_counts);
      const std::vector<int> filed_under = row_experts(ch.recv_counts);
      std::vector<size_t> exchange_row(filed_under.size());
      for (size_t t = 0; t < filed_under.size(); ++t) {
        const int j = filed_under[t];
        exchange_row[t] = at[i - first][j] + t - recv_at[i - first][j];
      }
      const size_t M = ch.entry_row.size();
      ch.expert_dout.resize(M * d);
      for (size_t m = 0; m < M; ++m) {
        const size_t r = exchange_row[ch.entry_row[m]];
        const T* g = dy.data() + r * d;
        const T* y = ch.expert_out.data() + m * d;
        T* dout = ch.expert_dout.data() + m * d;
        const T weight = ch.entry_weight[m];
        double dot = 0;
        for (int k = 0; k < d; ++k) {
          dot += (double)g[k] * y[k];
          dout[k] = weight * g[k];
        }
        back[r * width + d + ch.entry_slot[m]] = static_cast<T>(dot);
      }
      std::vector<T> din(M * d, T(0));
      const std::vector<size_t> in_at = row_offsets(ch.expert_counts);
      for (size_t j = 0; j < C; ++j)
        swiglu_expert_backward_input(din.data() + in_at[j] * d, ch.expert_dout.data() + in_at[j] * d,
                                     ch.expert_in.data() + in_at[j] * d, ch.expert_cache[j], w.computed[j],
                                     ch.expert_counts[j], d, dm.expert_ff);
      for (size_t m = 0; m < M; ++m) {
        T* dst = back.data() + exchange_row[ch.entry_row[m]] * width;
        const T* src = din.data() + m * d;
        for (int k = 0; k < d; ++k) dst[k] += src[k];
      }
    }
    exchange->start_to_sources(moe_backward_tag(dm, ExchangePhase::kDispatchBackward, first), std::move(back),
                               width);
    detail::schedule_weight_gradients<T>(
        exchange, dm, first, C,
        [&](int i, size_t j) -> std::function<void()> {
          MoeChunk<T>& ch = c->chunks[i];
          return [&ch, r = row_offsets(ch.expert_counts)[j], j, d, ff = dm.expert_ff, p = w.computed[j]] {
            swiglu_expert_backward_weights(ch.expert_dout.data() + r * d, ch.expert_in.data() + r * d,
                                           ch.expert_cache[j], p, ch.expert_counts[j], d, ff);
          };
        },
        deferred, deferred_replicas);
  }
}

template <typename T>
void grouped_dispatch_backward_finish(T* dxn, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w,
                                      ExpertExchange<T>* exchange, const ModelConfig& cfg, const MoeDims& dm) {
  const int d = dm.hidden, K = c->group_slots, span = dm.backward_span(), width = d + K;
  std::vector<T> rows;
  for (int first = 0; first < dm.chunks; first += span) {
    exchange->finish_to_sources(moe_backward_tag(dm, ExchangePhase::kDispatchBackward, first), &rows);
    size_t row = 0;
    for (int i = first; i < first + span; ++i)
      for (const int u : c->chunks[i].plan_rows) {
        XD_CHECK(rows.size() >= (row + 1) * width);
        const T* src = rows.data() + row * width;
        const int* entry = c->group_entry.data() + c->group_first[u];
        const int n = c->group_first[u + 1] - c->group_first[u];
        T* dst = dxn + (size_t)c->plan.source_row[entry[0]] * d;
        for (int k = 0; k < d; ++k) dst[k] += src[k];
        for (int s = 0; s < n; ++s) c->dweight[entry[s]] = src[d + s];
        ++row;
      }
    XD_CHECK(rows.size() == row * width);
  }
  router_backward_combine(dxn, w.router, c->router, c->plan, c->dweight, xn, cfg, dm.router_call(), c->loss_scale);
}

#define XD_INSTANTIATE_GROUPED(T)                                                                              \
  template void grouped_route<T>(MoeCache<T>*, const T*, ExpertExchange<T>*, const ModelConfig&,               \
                                 const MoeDims&);                                                              \
  template void grouped_experts_forward<T>(MoeCache<T>*, const MoeWeights<T>&, ExpertExchange<T>*,            \
                                           const MoeDims&);                                                    \
  template void grouped_combine_finish<T>(T*, MoeCache<T>*, ExpertExchange<T>*, const MoeDims&);              \
  template void grouped_combine_backward_start<T>(MoeCache<T>*, const T*, ExpertExchange<T>*, const MoeDims&); \
  template void grouped_experts_backward<T>(MoeCache<T>*, const MoeWeights<T>&, ExpertExchange<T>*,           \
                                            const MoeDims&, std::vector<std::function<void()>>*,              \
                                            std::vector<std::function<void()>>*);                             \
  template void grouped_dispatch_backward_finish<T>(T*, MoeCache<T>*, const T*, const MoeWeights<T>&,         \
                                                    ExpertExchange<T>*, const ModelConfig&, const MoeDims&);
XD_INSTANTIATE_GROUPED(float)
XD_INSTANTIATE_GROUPED(double)

}  // namespace detail
}  // namespace xd
