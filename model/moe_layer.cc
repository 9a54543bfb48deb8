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

}  // namespace

template <typename T>
void moe_forward(T* shared_out, T* routed_out, MoeCache<T>* c, const T* xn,
                 const MoeWeights<T>& w, ExpertExchange<T>* exchange, const ModelConfig& cfg,
                 const MoeDims& dm) {
  const int N = dm.num_tokens, d = dm.hidden, E = cfg.num_experts;
  c->logits.resize((size_t)N * E);
  linear_forward(c->logits.data(), xn, w.router, N, d, E);
  gate_forward(&c->plan, &c->gate, c->logits.data(), cfg, N);

  c->counts.resize(E);
  for (int e = 0; e < E; ++e) c->counts[e] = c->plan.count(e);
  std::vector<T> send;
  gather_rows(&send, xn, c->plan.token, d);
  exchange->to_experts({dm.layer, (int)ExchangePhase::kDispatch}, send.data(), c->counts, d,
                       &c->expert_in, &c->expert_counts);

  const size_t computed = exchange->computed_experts().size();
  XD_CHECK(w.computed.size() == computed && c->expert_counts.size() == computed);
  c->expert_cache.resize(computed);
  std::vector<T> expert_out(c->expert_in.size());
  size_t row = 0;
  for (size_t j = 0; j < computed; ++j) {
    const int n = c->expert_counts[j];
    swiglu_expert_forward(expert_out.data() + row * d, &c->expert_cache[j],
                          c->expert_in.data() + row * d, w.computed[j], n, d, dm.expert_ff);
    row += n;
  }
  exchange->to_sources({dm.layer, (int)ExchangePhase::kCombine}, expert_out.data(), d,
                       &c->routed_rows);

  std::fill(routed_out, routed_out + (size_t)N * d, T(0));
  for (int a = 0; a < c->plan.size(); ++a) {
    T* dst = routed_out + (size_t)c->plan.token[a] * d;
    const T* src = c->routed_rows.data() + (size_t)a * d;
    const T wa = c->plan.weight[a];
    for (int j = 0; j < d; ++j) dst[j] += wa * src[j];
  }

  std::fill(shared_out, shared_out + (size_t)N * d, T(0));
  c->shared_cache.resize(w.shared.size());
  c->shared_scratch.resize((size_t)N * d);
  for (size_t s = 0; s < w.shared.size(); ++s) {
    swiglu_expert_forward(c->shared_scratch.data(), &c->shared_cache[s], xn, w.shared[s], N, d,
                          dm.shared_ff);
    for (size_t j = 0; j < (size_t)N * d; ++j) shared_out[j] += c->shared_scratch[j];
  }
}

template <typename T>
void moe_backward(T* dxn, const T* dshared, const T* drouted, MoeCache<T>* c, const T* xn,
                  const MoeWeights<T>& w, ExpertExchange<T>* exchange, const ModelConfig& cfg,
                  const MoeDims& dm, double loss_scale) {
  const int N = dm.num_tokens, d = dm.hidden, E = cfg.num_experts;
  const int A = c->plan.size();

  // Combine backward: d(weight) locally, weighted output grads to the experts.
  std::vector<T> dweight(A), dy((size_t)A * d);
  for (int a = 0; a < A; ++a) {
    const T* g = drouted + (size_t)c->plan.token[a] * d;
    const T* y = c->routed_rows.data() + (size_t)a * d;
    double dot = 0;
    for (int j = 0; j < d; ++j) {
      dot += (double)g[j] * y[j];
      dy[(size_t)a * d + j] = c->plan.weight[a] * g[j];
    }
    dweight[a] = static_cast<T>(dot);
  }
  std::vector<T> dy_local;
  std::vector<int> counts_local;
  exchange->to_experts({dm.layer, (int)ExchangePhase::kCombineBackward}, dy.data(), c->counts, d,
                       &dy_local, &counts_local);
  XD_CHECK(counts_local == c->expert_counts);

  std::vector<T> dx_local(c->expert_in.size(), T(0));
  size_t row = 0;
  for (size_t j = 0; j < c->expert_counts.size(); ++j) {
    const int n = c->expert_counts[j];
    swiglu_expert_backward(dx_local.data() + row * d, dy_local.data() + row * d,
                           c->expert_in.data() + row * d, c->expert_cache[j], w.computed[j], n, d,
                           dm.expert_ff);
    row += n;
  }
  std::vector<T> dx_rows;
  exchange->to_sources({dm.layer, (int)ExchangePhase::kDispatchBackward}, dx_local.data(), d,
                       &dx_rows);
  for (int a = 0; a < A; ++a) {
    T* dst = dxn + (size_t)c->plan.token[a] * d;
    const T* src = dx_rows.data() + (size_t)a * d;
    for (int j = 0; j < d; ++j) dst[j] += src[j];
  }

  std::vector<T> dlogits((size_t)N * E, T(0));
  gate_backward(dlogits.data(), dweight, c->plan, c->gate, cfg, loss_scale);
  linear_backward(dxn, w.drouter, dlogits.data(), xn, w.router, N, d, E);

  for (size_t s = 0; s < w.shared.size(); ++s)
    swiglu_expert_backward(dxn, dshared, xn, c->shared_cache[s], w.shared[s], N, d, dm.shared_ff);
}

#define XD_INSTANTIATE_MOE(T)                                                                   \
  template void moe_forward<T>(T*, T*, MoeCache<T>*, const T*, const MoeWeights<T>&,            \
                               ExpertExchange<T>*, const ModelConfig&, const MoeDims&);         \
  template void moe_backward<T>(T*, const T*, const T*, MoeCache<T>*, const T*,                 \
                                const MoeWeights<T>&, ExpertExchange<T>*, const ModelConfig&,   \
                                const MoeDims&, double);
XD_INSTANTIATE_MOE(float)
XD_INSTANTIATE_MOE(double)

}  // namespace xd
