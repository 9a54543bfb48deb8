#include "model/moe_layer.h"

#include <cstring>

#include "common/check.h"
#include "model/ops.h"

namespace xd {

namespace {

template <typename T>
void gather_rows(std::vector<T>* out, const T* src, const std::vector<int>& rows, int d) {
  out->resize(rows.size() * (size_t)d);
  for (size_t a = 0; a < rows.size(); ++a)
    std::memcpy(out->data() + a * d, src + (size_t)rows[a] * d, sizeof(T) * d);
}

ExchangeTag tag_of(const MoeDims& dm, ExchangePhase phase, int chunk) {
  return ExchangeTag{dm.layer, static_cast<int>(phase), chunk};
}

// Splits each expert's plan rows into `r` contiguous parts; chunk i takes the
// i-th part of every expert, so each chunk is grouped by expert too.
template <typename T>
void split_into_chunks(MoeCache<T>* c, int r) {
  const DispatchPlan<T>& plan = c->plan;
  const int E = plan.num_experts;
  c->chunks.resize(r);
  for (int i = 0; i < r; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    ch.plan_rows.clear();
    ch.counts.assign(E, 0);
    for (int e = 0; e < E; ++e) {
      const int n = plan.count(e), first = plan.expert_offsets[e];
      const int begin = first + (int)((int64_t)n * i / r), end = first + (int)((int64_t)n * (i + 1) / r);
      for (int a = begin; a < end; ++a) ch.plan_rows.push_back(a);
      ch.counts[e] = end - begin;
    }
  }
}

}  // namespace

template <typename T>
void moe_route_forward(MoeCache<T>* c, const T* xn, const MoeWeights<T>& w, ExpertExchange<T>* exchange,
                       const ModelConfig& cfg, const MoeDims& dm) {
  const int N = dm.num_tokens, d = dm.hidden, E = cfg.num_experts;
  XD_CHECK(dm.chunks >= 1);
  c->logits.resize((size_t)N * E);
  linear_forward(c->logits.data(), xn, w.router, N, d, E);
  gate_forward(&c->plan, &c->gate, c->logits.data(), cfg, N);
  split_into_chunks(c, dm.chunks);
  std::vector<int> tokens;
  for (int i = 0; i < dm.chunks; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    tokens.resize(ch.plan_rows.size());
    for (size_t k = 0; k < tokens.size(); ++k) tokens[k] = c->plan.token[ch.plan_rows[k]];
    std::vector<T> send;
    gather_rows(&send, xn, tokens, d);
    exchange->start_to_experts(tag_of(dm, ExchangePhase::kDispatch, i), std::move(send), ch.counts, d);
  }
}

template <typename T>
void moe_experts_forward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange, const MoeDims& dm) {
  const int d = dm.hidden;
  const size_t computed = exchange->computed_experts().size();
  XD_CHECK(w.computed.size() == computed);
  for (int i = 0; i < dm.chunks; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    exchange->finish_to_experts(tag_of(dm, ExchangePhase::kDispatch, i), &ch.expert_in, &ch.expert_counts);
    XD_CHECK(ch.expert_counts.size() == computed);
    ch.expert_cache.resize(computed);
    std::vector<T> out(ch.expert_in.size());
    size_t row = 0;
    for (size_t j = 0; j < computed; ++j) {
      const int n = ch.expert_counts[j];
      swiglu_expert_forward(out.data() + row * d, &ch.expert_cache[j], ch.expert_in.data() + row * d,
                            w.computed[j], n, d, dm.expert_ff);
      row += n;
    }
    exchange->start_to_sources(tag_of(dm, ExchangePhase::kCombine, i), std::move(out), d);
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
  const int d = dm.hidden;
  c->routed_rows.resize((size_t)c->plan.size() * d);
  std::vector<T> back;
  for (int i = 0; i < dm.chunks; ++i) {
    const MoeChunk<T>& ch = c->chunks[i];
    exchange->finish_to_sources(tag_of(dm, ExchangePhase::kCombine, i), &back);
    XD_CHECK(back.size() == ch.plan_rows.size() * (size_t)d);
    for (size_t k = 0; k < ch.plan_rows.size(); ++k)
      std::memcpy(c->routed_rows.data() + (size_t)ch.plan_rows[k] * d, back.data() + k * d, sizeof(T) * d);
  }
  std::fill(routed_out, routed_out + (size_t)dm.num_tokens * d, T(0));
  for (int a = 0; a < c->plan.size(); ++a) {
    T* dst = routed_out + (size_t)c->plan.token[a] * d;
    const T* src = c->routed_rows.data() + (size_t)a * d;
    const T wa = c->plan.weight[a];
    for (int j = 0; j < d; ++j) dst[j] += wa * src[j];
  }
}

template <typename T>
void moe_combine_backward_start(MoeCache<T>* c, const T* drouted, ExpertExchange<T>* exchange, const MoeDims& dm) {
  const int d = dm.hidden;
  // d(weight) locally; the weighted output grads go to the experts, written
  // straight into each chunk's send rows.
  c->dweight.resize(c->plan.size());
  for (int i = 0; i < dm.chunks; ++i) {
    const MoeChunk<T>& ch = c->chunks[i];
    std::vector<T> send(ch.plan_rows.size() * (size_t)d);
    for (size_t k = 0; k < ch.plan_rows.size(); ++k) {
      const int a = ch.plan_rows[k];
      const T* g = drouted + (size_t)c->plan.token[a] * d;
      const T* y = c->routed_rows.data() + (size_t)a * d;
      T* dy = send.data() + k * d;
      double dot = 0;
      for (int j = 0; j < d; ++j) {
        dot += (double)g[j] * y[j];
        dy[j] = c->plan.weight[a] * g[j];
      }
      c->dweight[a] = static_cast<T>(dot);
    }
    exchange->start_to_experts(tag_of(dm, ExchangePhase::kCombineBackward, i), std::move(send), ch.counts, d);
  }
}

template <typename T>
void moe_router_backward(T* dxn, MoeCache<T>* c, const T* xn, const MoeWeights<T>& w, const ModelConfig& cfg,
                         const MoeDims& dm, double loss_scale) {
  const int N = dm.num_tokens, E = cfg.num_experts;
  XD_CHECK((int)c->dweight.size() == c->plan.size());
  std::vector<T> dlogits((size_t)N * E, T(0));
  gate_backward(dlogits.data(), c->dweight, c->plan, c->gate, cfg, loss_scale);
  linear_backward(dxn, w.drouter, dlogits.data(), xn, w.router, N, dm.hidden, E);
}

template <typename T>
void moe_experts_backward(MoeCache<T>* c, const MoeWeights<T>& w, ExpertExchange<T>* exchange, const MoeDims& dm) {
  const int d = dm.hidden;
  for (int i = 0; i < dm.chunks; ++i) {
    MoeChunk<T>& ch = c->chunks[i];
    std::vector<int> counts;
    exchange->finish_to_experts(tag_of(dm, ExchangePhase::kCombineBackward, i), &ch.expert_dout, &counts);
    XD_CHECK(counts == ch.expert_counts);
    std::vector<T> din(ch.expert_in.size(), T(0));
    size_t row = 0;
    for (size_t j = 0; j < ch.expert_counts.size(); ++j) {
      const int n = ch.expert_counts[j];
      swiglu_expert_backward_input(din.data() + row * d, ch.expert_dout.data() + row * d,
                                   ch.expert_in.data() + row * d, ch.expert_cache[j], w.computed[j], n, d,
                                   dm.expert_ff);
      row += n;
    }
    exchange->start_to_sources(tag_of(dm, ExchangePhase::kDispatchBackward, i), std::move(din), d);
    row = 0;
    for (size_t j = 0; j < ch.expert_counts.size(); ++j) {
      const int n = ch.expert_counts[j];
      swiglu_expert_backward_weights(ch.expert_dout.data() + row * d, ch.expert_in.data() + row * d,
                                     ch.expert_cache[j], w.computed[j], n, d, dm.expert_ff);
      row += n;
    }
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
void moe_dispatch_backward_finish(T* dxn, MoeCache<T>* c, ExpertExchange<T>* exchange, const MoeDims& dm) {
  const int d = dm.hidden;
  std::vector<T> rows;
  for (int i = 0; i < dm.chunks; ++i) {
    const MoeChunk<T>& ch = c->chunks[i];
    exchange->finish_to_sources(tag_of(dm, ExchangePhase::kDispatchBackward, i), &rows);
    XD_CHECK(rows.size() == ch.plan_rows.size() * (size_t)d);
    for (size_t k = 0; k < ch.plan_rows.size(); ++k) {
      T* dst = dxn + (size_t)c->plan.token[ch.plan_rows[k]] * d;
      const T* src = rows.data() + k * d;
      for (int j = 0; j < d; ++j) dst[j] += src[j];
    }
  }
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
  template void moe_combine_backward_start<T>(MoeCache<T>*, const T*, ExpertExchange<T>*, const MoeDims&);    \
  template void moe_router_backward<T>(T*, MoeCache<T>*, const T*, const MoeWeights<T>&, const ModelConfig&,  \
                                       const MoeDims&, double);                                               \
  template void moe_experts_backward<T>(MoeCache<T>*, const MoeWeights<T>&, ExpertExchange<T>*,               \
                                        const MoeDims&);                                                      \
  template void moe_shared_backward<T>(T*, const T*, MoeCache<T>*, const T*, const MoeWeights<T>&,            \
                                       const MoeDims&);                                                       \
  template void moe_dispatch_backward_finish<T>(T*, MoeCache<T>*, ExpertExchange<T>*, const MoeDims&);        \
  template void moe_forward<T>(T*, T*, MoeCache<T>*, const T*, const MoeWeights<T>&, ExpertExchange<T>*,      \
                               const ModelConfig&, const MoeDims&);
XD_INSTANTIATE_MOE(float)
XD_INSTANTIATE_MOE(double)

}  // namespace xd
