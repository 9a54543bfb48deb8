#include "model/moe_layer.h"

#include <cstring>

#include "common/check.h"
#include "model/detail/moe_grouped.h"
#include "model/detail/moe_pieces.h"
#include "model/ops.h"

namespace xd {

namespace {

using detail::row_offsets;

using detail::moe_backward_tag;
using detail::moe_tag;

}  // namespace

template <typename T>
void moe_route_forward(MoeCache<T>* c, const T* xn, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                       const ModelConfig& cfg, const MoeDims& dm) {
  const int d = dm.hidden;
  XD_CHECK(dm.chunks >= 1);
  router_forward(&c->router, &c->plan, xn, w.router, cfg, dm.router_call());
  const T* source = router_source(c->router, xn, cfg);
  if (dm.once_per_worker) return detail::grouped_route(c, source, exchange, cfg, dm);
  detail::split_into_chunks(c, dm.chunks, c->plan.expert_offsets);
  for (int i = 0; i < dm.chunks; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    std::vector<T> send;
    order_gather(&send, source, c->plan, ch.plan_rows, d);
    exchange->start_to_experts(moe_tag(dm, ExchangePhase::kDispatch, i), std::move(send), ch.counts, d);
  }
}

template <typename T>
void moe_experts_forward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange, const MoeDims& dm) {
  if (dm.once_per_worker) return detail::grouped_experts_forward(c, w, exchange, dm);
  const int d = dm.hidden;
  const size_t computed = exchange->computed_experts().size();
  XD_CHECK(w.computed.size() == computed);
  for (int i = 0; i < dm.chunks; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    exchange->finish_to_experts(moe_tag(dm, ExchangePhase::kDispatch, i), &ch.expert_in, &ch.expert_counts);
    XD_CHECK(ch.expert_counts.size() == computed);
    std::vector<T> out(ch.expert_in.size());
    detail::experts_forward(out.data(), &ch, w, exchange, dm);
    exchange->start_to_sources(moe_tag(dm, ExchangePhase::kCombine, i), std::move(out), d);
  }
}

template <typename T>
void moe_shared_forward(T* shared_out, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w, const MoeDims& dm) {
  const size_t Nd = (size_t)dm.num_tokens * dm.hidden;
  std::fill(shared_out, shared_out + Nd, T(0));
  c->shared_cache.resize(w.shared.size());
  c->shared_scratch.resize(Nd);
  for (size_t s = 0; s < w.shared.size(); ++s) {
    swiglu_expert_forward(c->shared_scratch.data(), &c->shared_cache[s], xn, w.shared[s], dm.num_tokens,
                          dm.hidden, dm.shared_ff);
    for (size_t j = 0; j < Nd; ++j) shared_out[j] += c->shared_scratch[j];
  }
}

template <typename T>
void moe_combine_finish(T* routed_out, MoeCache<T>* c, ExpertExchange<T>* exchange, const MoeDims& dm) {
  if (dm.once_per_worker) return detail::grouped_combine_finish(routed_out, c, exchange, dm);
  detail::finish_combines(&c->routed_rows, c->plan.size(), *c, exchange, dm);
  order_combine(routed_out, c->routed_rows.data(), c->plan, dm.hidden);
}

template <typename T>
bool moe_dispatch_landed(const ExpertExchange<T>& exchange, const MoeDims& dm) {
  return exchange.landed(moe_tag(dm, ExchangePhase::kDispatch, 0));
}

template <typename T>
bool moe_combine_landed(const ExpertExchange<T>& exchange, const MoeDims& dm) {
  for (int i = 0; i < dm.chunks; ++i)
    if (!exchange.landed(moe_tag(dm, ExchangePhase::kCombine, i))) return false;
  return true;
}

template <typename T>
bool moe_combine_backward_landed(const ExpertExchange<T>& exchange, const MoeDims& dm) {
  return exchange.landed(moe_backward_tag(dm, ExchangePhase::kCombineBackward, 0));
}

template <typename T>
void moe_combine_backward_start(MoeCache<T>* c, const T* drouted, ExpertExchange<T>* exchange, const MoeDims& dm) {
  if (dm.once_per_worker) return detail::grouped_combine_backward_start(c, drouted, exchange, dm);
  const int d = dm.hidden, span = dm.backward_span();
  XD_CHECK(span >= 1 && dm.chunks % span == 0);
  // d(weight) locally; the weighted output grads go to the experts, written
  // straight into the send rows, chunk after chunk of each exchange.
  c->dweight.resize(c->plan.size());
  for (int first = 0; first < dm.chunks; first += span) {
    size_t rows = 0;
    std::vector<int> counts;
    for (int i = first; i < first + span; ++i) {
      rows += c->chunks[i].plan_rows.size();
      counts.insert(counts.end(), c->chunks[i].counts.begin(), c->chunks[i].counts.end());
    }
    // Each row appended as g, then scaled in place: no zero fill first.
    std::vector<T> send;
    send.reserve(rows * (size_t)d);
    for (int i = first; i < first + span; ++i)
      for (const int a : c->chunks[i].plan_rows) {
        const T* g = drouted + (size_t)c->plan.token[a] * d;
        const T* y = c->routed_rows.data() + (size_t)a * d;
        send.insert(send.end(), g, g + d);
        T* dy = send.data() + send.size() - d;
        const T weight = c->plan.weight[a];
        double dot = 0;
        for (int j = 0; j < d; ++j) {
          dot += (double)g[j] * y[j];
          dy[j] *= weight;
        }
        c->dweight[a] = static_cast<T>(dot);
      }
    exchange->start_to_experts(moe_backward_tag(dm, ExchangePhase::kCombineBackward, first), std::move(send), counts,
                               d);
  }
}

template <typename T>
void moe_router_backward(T* dxn, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w, const ModelConfig& cfg,
                         const MoeDims& dm, double loss_scale) {
  if (dm.once_per_worker) {  // the experts' d(weight) comes with the backward of Dispatch
    c->loss_scale = loss_scale;
    return;
  }
  router_backward_combine(dxn, w.router, c->router, c->plan, c->dweight, xn, cfg, dm.router_call(), loss_scale);
}

template <typename T>
void moe_experts_backward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange, const MoeDims& dm,
                          std::vector<std::function<void()>>* deferred,
                          std::vector<std::function<void()>>* deferred_replicas) {
  if (dm.once_per_worker) return detail::grouped_experts_backward(c, w, exchange, dm, deferred, deferred_replicas);
  const int d = dm.hidden, span = dm.backward_span();
  for (int first = 0; first < dm.chunks; first += span) {
    // One exchange's rows: grouped by computed expert, and within an expert
    // by chunk; they stay in the first chunk's expert_dout. Chunk i's block
    // of expert j starts at at[i - first][j] there, and at in_at[i - first][j]
    // in the chunk's own expert_in.
    std::vector<T>& dout = c->chunks[first].expert_dout;
    std::vector<int> counts;
    exchange->finish_to_experts(moe_backward_tag(dm, ExchangePhase::kCombineBackward, first), &dout, &counts);
    const size_t computed = counts.size();
    std::vector<std::vector<size_t>> at, in_at(span);
    const size_t rows = detail::backward_exchange_layout(
        &at, counts, first, span, [c](int i) -> const std::vector<int>& { return c->chunks[i].expert_counts; });
    XD_CHECK(dout.size() == rows * d);
    for (int i = first; i < first + span; ++i) in_at[i - first] = row_offsets(c->chunks[i].expert_counts);
    std::vector<T> din(dout.size(), T(0));
    for (int i = first; i < first + span; ++i) {
      MoeChunk<T>& ch = c->chunks[i];
      for (size_t j = 0; j < computed; ++j) {
        const size_t r = at[i - first][j];
        swiglu_expert_backward_input(din.data() + r * d, dout.data() + r * d,
                                     ch.expert_in.data() + in_at[i - first][j] * d, ch.expert_cache[j],
                                     w.computed[j], ch.expert_counts[j], d, dm.expert_ff);
      }
    }
    exchange->start_to_sources(moe_backward_tag(dm, ExchangePhase::kDispatchBackward, first), std::move(din), d);
    // Replicas first: their gradients leave once the last chunk's are final.
    // Each expert's gradient takes its chunks in order, whatever the span.
    detail::schedule_weight_gradients<T>(
        exchange, dm, first, computed,
        [&, first](int i, size_t j) -> std::function<void()> {
          MoeChunk<T>& ch = c->chunks[i];
          const T* dy = dout.data() + at[i - first][j] * d;
          return [&ch, dy, r = in_at[i - first][j], j, d, ff = dm.expert_ff, p = w.computed[j]] {
            swiglu_expert_backward_weights(dy, ch.expert_in.data() + r * d, ch.expert_cache[j], p,
                                           ch.expert_counts[j], d, ff);
          };
        },
        deferred, deferred_replicas);
  }
}

template <typename T>
void moe_shared_backward(T* dxn, const T* dshared, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w,
                         const MoeDims& dm) {
  for (size_t s = 0; s < w.shared.size(); ++s)
    swiglu_expert_backward(dxn, dshared, xn, c->shared_cache[s], w.shared[s], dm.num_tokens, dm.hidden,
                           dm.shared_ff);
}

template <typename T>
void moe_dispatch_backward_finish(T* dxn, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w,
                                  ExpertExchange<T>* exchange, const ModelConfig& cfg, const MoeDims& dm) {
  if (dm.once_per_worker) return detail::grouped_dispatch_backward_finish(dxn, c, xn, w, exchange, cfg, dm);
  const int d = dm.hidden;
  const bool slots = router_mixes_tokens(cfg);
  if (slots) c->dsource.assign(c->router.slot_inputs.size(), T(0));
  T* dsource = slots ? c->dsource.data() : dxn;
  std::vector<T> rows;
  const int span = dm.backward_span();
  for (int first = 0; first < dm.chunks; first += span) {
    exchange->finish_to_sources(moe_backward_tag(dm, ExchangePhase::kDispatchBackward, first), &rows);
    size_t row = 0;
    for (int i = first; i < first + span; ++i) {
      const MoeChunk<T>& ch = c->chunks[i];
      XD_CHECK(rows.size() >= (row + ch.plan_rows.size()) * d);
      order_scatter_add(dsource, rows.data() + row * d, c->plan, ch.plan_rows, d);
      row += ch.plan_rows.size();
    }
    XD_CHECK(rows.size() == row * d);
  }
  if (slots) router_backward_dispatch(dxn, w.router, c->router, c->dsource.data(), xn, cfg, dm.router_call());
}

template <typename T>
void moe_forward(T* shared_out, T* routed_out, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w,
                 ExpertExchange<T>* exchange, const ModelConfig& cfg, const MoeDims& dm) {
  moe_route_forward(c, xn, w, exchange, cfg, dm);
  moe_experts_forward(c, w, exchange, dm);
  moe_combine_finish(routed_out, c, exchange, dm);
  moe_shared_forward(shared_out, c, xn, w, dm);
}

#define XD_INSTANTIATE_MOE(T)                                                                                 \
  template void moe_route_forward<T>(MoeCache<T>*, const T*, const MoeWeights<T>&, ExpertExchange<T>*,        \
                                     const ModelConfig&, const MoeDims&);                                     \
  template void moe_experts_forward<T>(MoeCache<T>*, const MoeWeights<T>&, ExpertExchange<T>*,                \
                                       const MoeDims&);                                                       \
  template void moe_shared_forward<T>(T*, MoeCache<T>*, const T*, const MoeWeights<T>&, const MoeDims&);      \
  template void moe_combine_finish<T>(T*, MoeCache<T>*, ExpertExchange<T>*, const MoeDims&);                  \
  template bool moe_dispatch_landed<T>(const ExpertExchange<T>&, const MoeDims&);                             \
  template bool moe_combine_landed<T>(const ExpertExchange<T>&, const MoeDims&);                              \
  template bool moe_combine_backward_landed<T>(const ExpertExchange<T>&, const MoeDims&);                     \
  template void moe_combine_backward_start<T>(MoeCache<T>*, const T*, ExpertExchange<T>*, const MoeDims&);    \
  template void moe_router_backward<T>(T*, MoeCache<T>*, const T*, const MoeWeights<T>&, const ModelConfig&,  \
                                       const MoeDims&, double);                                               \
  template void moe_experts_backward<T>(MoeCache<T>*, const MoeWeights<T>&, ExpertExchange<T>*,               \
                                        const MoeDims&, std::vector<std::function<void()>>*,                  \
                                        std::vector<std::function<void()>>*);                                 \
  template void moe_shared_backward<T>(T*, const T*, MoeCache<T>*, const T*, const MoeWeights<T>&,            \
                                       const MoeDims&);                                                       \
  template void moe_dispatch_backward_finish<T>(T*, MoeCache<T>*, const T*, const MoeWeights<T>&,             \
                                                ExpertExchange<T>*, const ModelConfig&, const MoeDims&);    \
  template void moe_forward<T>(T*, T*, MoeCache<T>*, const T*, const MoeWeights<T>&, ExpertExchange<T>*,      \
                               const ModelConfig&, const MoeDims&);
XD_INSTANTIATE_MOE(float)
XD_INSTANTIATE_MOE(double)

}  // namespace xd
