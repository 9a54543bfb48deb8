#include "model/router.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/check.h"
#include "common/rng.h"
#include "model/gemm.h"
#include "model/ops.h"

namespace xd {

namespace {

constexpr uint64_t kNoiseTag = 0x6E6F6973652D7865ull;
constexpr double kNormFloor = 1e-12;  // unit rows divide by max(norm, floor)

double softplus(double x) { return x > 30 ? x : std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// unit (n, k) = rows of m over max(their L2 norm, floor); norm (n) keeps the divisor.
template <typename T>
void unit_rows(std::vector<T>* unit, std::vector<T>* norm, const T* m, int n, int k) {
  unit->resize((size_t)n * k);
  norm->resize(n);
  for (int i = 0; i < n; ++i) {
    double ss = 0;
    for (int j = 0; j < k; ++j) ss += (double)m[(size_t)i * k + j] * m[(size_t)i * k + j];
    const double r = std::max(std::sqrt(ss), kNormFloor);
    (*norm)[i] = static_cast<T>(r);
    for (int j = 0; j < k; ++j) (*unit)[(size_t)i * k + j] = static_cast<T>(m[(size_t)i * k + j] / r);
  }
}

// dm (n, k) += d(unit)/dm applied to du: (du - u (u . du)) / norm, or du / floor
// where the floor was taken.
template <typename T>
void unit_rows_backward(T* dm, const T* du, const std::vector<T>& unit, const std::vector<T>& norm, int n, int k) {
  for (int i = 0; i < n; ++i) {
    const T* u = unit.data() + (size_t)i * k;
    const T* g = du + (size_t)i * k;
    const double r = norm[i];
    double dot = 0;
    if (r > kNormFloor)
      for (int j = 0; j < k; ++j) dot += (double)u[j] * g[j];
    for (int j = 0; j < k; ++j) dm[(size_t)i * k + j] += static_cast<T>((g[j] - u[j] * dot) / r);
  }
}

// --- SoftMoE (causal): slot s at position t mixes tokens 0..t of its sequence.
template <typename T>
void soft_moe_forward(RouterCache<T>* c, DispatchPlan<T>* plan, const T* xn, const RouterWeights<T>& w,
                      const ModelConfig& cfg, const RouterCall& call) {
  const int N = call.num_tokens, len = call.seq_len, d = cfg.hidden_size;
  const int E = cfg.num_experts, p = cfg.soft_moe_slots, S = E * p;
  XD_CHECK(len > 0 && N % len == 0);
  XD_CHECK((int64_t)N * S < (int64_t)INT32_MAX);  // slot rows are indexed by int
  const int B = N / len;
  c->logits.resize((size_t)N * S);
  linear_forward(c->logits.data(), xn, w.gate, N, d, S);
  c->combine.resize((size_t)N * S);
  c->slot_lse.resize(N);
  double z = 0;
  for (int n = 0; n < N; ++n) {
    c->slot_lse[n] = softmax_row(c->combine.data() + (size_t)n * S, c->logits.data() + (size_t)n * S, S);
    z += c->slot_lse[n] * c->slot_lse[n];
  }
  c->gate = GateCache<T>{};
  c->gate.num_tokens = N;
  c->gate.z_loss = N > 0 ? z / N : 0.0;

  c->dispatch.assign((size_t)B * S * len * len, T(0));
  c->slot_inputs.resize((size_t)N * S * d);
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < S; ++s) {
      T* D = c->dispatch.data() + ((size_t)b * S + s) * len * len;
      const T* l = c->logits.data() + (size_t)b * len * S + s;  // stride S
      for (int t = 0; t < len; ++t) {
        double mx = l[0];
        for (int u = 1; u <= t; ++u) mx = std::max<double>(mx, l[(size_t)u * S]);
        double sum = 0;
        for (int u = 0; u <= t; ++u) sum += std::exp(l[(size_t)u * S] - mx);
        for (int u = 0; u <= t; ++u) D[(size_t)t * len + u] = static_cast<T>(std::exp(l[(size_t)u * S] - mx) / sum);
      }
      // X~_{b,s} (len, d) = D (len, len) X_b (len, d), into rows (b*len + t)*S + s.
      gemm<T>(false, false, len, d, len, T(1), D, len, xn + (size_t)b * len * d, d, T(0),
              c->slot_inputs.data() + ((size_t)b * len * S + s) * d, S * d);
    }

  std::vector<RouteAssignment<T>> asg;
  asg.reserve((size_t)N * S);
  for (int n = 0; n < N; ++n)
    for (int s = 0; s < S; ++s) asg.push_back({s / p, n * S + s, n, c->combine[(size_t)n * S + s]});
  order_plan(plan, asg, N, E);
  plan->dropped = 0;
}

template <typename T>
void soft_moe_backward_combine(T* dxn, const RouterWeights<T>& w, const RouterCache<T>& c,
                               const DispatchPlan<T>& plan, const std::vector<T>& dweight, const T* xn,
                               const ModelConfig& cfg, const RouterCall& call, double loss_scale) {
  const int N = call.num_tokens, d = cfg.hidden_size, S = cfg.num_experts * cfg.soft_moe_slots;
  std::vector<double> dc((size_t)N * S, 0.0);
  for (int a = 0; a < plan.size(); ++a)
    dc[(size_t)plan.token[a] * S + plan.source_row[a] % S] += dweight[a];
  std::vector<T> dlogits((size_t)N * S);
  for (int n = 0; n < N; ++n) {
    const T* C = c.combine.data() + (size_t)n * S;
    const double lse = c.slot_lse[n];
    double dot = 0;
    for (int s = 0; s < S; ++s) dot += dc[(size_t)n * S + s] * C[s];
    for (int s = 0; s < S; ++s)
      dlogits[(size_t)n * S + s] = static_cast<T>(
          loss_scale * (C[s] * (dc[(size_t)n * S + s] - dot) + cfg.z_loss_coef * 2.0 * lse * C[s] / N));
  }
  linear_backward(dxn, w.dgate, dlogits.data(), xn, w.gate, N, d, S);
}

template <typename T>
void soft_moe_backward_dispatch(T* dxn, const RouterWeights<T>& w, const RouterCache<T>& c, const T* dsource,
                                const T* xn, const ModelConfig& cfg, const RouterCall& call) {
  const int N = call.num_tokens, len = call.seq_len, d = cfg.hidden_size;
  const int S = cfg.num_experts * cfg.soft_moe_slots, B = N / len;
  std::vector<T> dlogits((size_t)N * S, T(0)), dD((size_t)len * len);
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < S; ++s) {
      const T* D = c.dispatch.data() + ((size_t)b * S + s) * len * len;
      const T* dX = dsource + ((size_t)b * len * S + s) * d;  // rows stride S*d
      const T* X = xn + (size_t)b * len * d;
      gemm<T>(true, false, len, d, len, T(1), D, len, dX, S * d, T(1), dxn + (size_t)b * len * d, d);
      gemm<T>(false, true, len, len, d, T(1), dX, S * d, X, d, T(0), dD.data(), len);
      T* dl = dlogits.data() + (size_t)b * len * S + s;  // stride S
      for (int t = 0; t < len; ++t) {
        double dot = 0;
        for (int u = 0; u <= t; ++u) dot += (double)D[(size_t)t * len + u] * dD[(size_t)t * len + u];
        for (int u = 0; u <= t; ++u)
          dl[(size_t)u * S] += static_cast<T>(D[(size_t)t * len + u] * (dD[(size_t)t * len + u] - dot));
      }
    }
  linear_backward(dxn, w.dgate, dlogits.data(), xn, w.gate, N, d, S);
}

// X-MoE's cosine logits are bounded by 1/temperature already; a z-loss on
// them would only push the learnt temperature up and flatten the routing
// (measured: docs/model.md), and X-MoE has none. The other gatings keep it.
ModelConfig gate_config(const ModelConfig& cfg) {
  ModelConfig g = cfg;
  if (cfg.gating == Gating::kXMoe) g.z_loss_coef = 0;
  return g;
}

}  // namespace

bool router_mixes_tokens(const ModelConfig& cfg) { return cfg.gating == Gating::kSoftMoe; }

void routing_noise(double* eps, const RoutingContext& ctx, int layer, int64_t global_token, int n, int num_experts) {
  for (int i = 0; i < n; ++i) {
    uint64_t key = splitmix64(ctx.seed ^ kNoiseTag);
    key = splitmix64(key ^ ctx.step);
    key = splitmix64(key ^ static_cast<uint64_t>(layer));
    key = splitmix64(key ^ static_cast<uint64_t>(global_token + i));
    Rng rng(key);
    for (int e = 0; e < num_experts; ++e) eps[(size_t)i * num_experts + e] = rng.normal();
  }
}

template <typename T>
void router_forward(RouterCache<T>* c, DispatchPlan<T>* plan, const T* xn, const RouterWeights<T>& w,
                    const ModelConfig& cfg, const RouterCall& call) {
  const int N = call.num_tokens, d = cfg.hidden_size, E = cfg.num_experts;
  if (cfg.gating == Gating::kSoftMoe) return soft_moe_forward(c, plan, xn, w, cfg, call);
  c->logits.resize((size_t)N * E);
  if (cfg.gating == Gating::kXMoe) {
    XD_CHECK(w.experts && w.log_scale);
    const int de = cfg.resolved_router_dim();
    std::vector<T> h((size_t)N * de);
    linear_forward(h.data(), xn, w.gate, N, d, de);
    unit_rows(&c->proj, &c->proj_norm, h.data(), N, de);
    unit_rows(&c->expert_unit, &c->expert_norm, w.experts, E, de);
    c->cosine.resize((size_t)N * E);
    gemm<T>(false, true, N, E, de, T(1), c->proj.data(), de, c->expert_unit.data(), de, T(0), c->cosine.data(), E);
    const double scale = std::exp((double)w.log_scale[0]);
    for (size_t i = 0; i < c->logits.size(); ++i) c->logits[i] = static_cast<T>(scale * c->cosine[i]);
  } else {
    linear_forward(c->logits.data(), xn, w.gate, N, d, E);
    c->noisy = cfg.gating == Gating::kGShardNoisyTopK && call.context.training;
    if (c->noisy) {
      XD_CHECK(w.noise);
      c->noise_raw.resize((size_t)N * E);
      linear_forward(c->noise_raw.data(), xn, w.noise, N, d, E);
      std::vector<double> eps((size_t)N * E);
      const int64_t first_token = call.context.first_row * call.seq_len;
      routing_noise(eps.data(), call.context, call.layer, first_token, N, E);
      c->noise.assign(eps.begin(), eps.end());  // the backward reads the same (rounded) draws
      for (size_t i = 0; i < c->logits.size(); ++i)
        c->logits[i] = static_cast<T>(c->logits[i] + c->noise[i] * softplus(c->noise_raw[i]));
    }
  }
  gate_forward(plan, &c->gate, c->logits.data(), cfg, N);
  if (cfg.gating == Gating::kXMoe) c->gate.z_loss = 0;  // see gate_config
}

template <typename T>
const T* router_source(const RouterCache<T>& c, const T* xn, const ModelConfig& cfg) {
  return router_mixes_tokens(cfg) ? c.slot_inputs.data() : xn;
}

template <typename T>
void router_backward_combine(T* dxn, const RouterWeights<T>& w, const RouterCache<T>& c, const DispatchPlan<T>& plan,
                             const std::vector<T>& dweight, const T* xn, const ModelConfig& cfg,
                             const RouterCall& call, double loss_scale) {
  XD_CHECK((int)dweight.size() == plan.size());
  if (cfg.gating == Gating::kSoftMoe)
    return soft_moe_backward_combine(dxn, w, c, plan, dweight, xn, cfg, call, loss_scale);
  const int N = call.num_tokens, d = cfg.hidden_size, E = cfg.num_experts;
  std::vector<T> dlogits((size_t)N * E, T(0));
  gate_backward(dlogits.data(), dweight, plan, c.gate, gate_config(cfg), loss_scale);
  if (cfg.gating == Gating::kXMoe) {
    const int de = cfg.resolved_router_dim();
    const double scale = std::exp((double)w.log_scale[0]);
    double dscale = 0;
    std::vector<T> dcos((size_t)N * E);
    for (size_t i = 0; i < dcos.size(); ++i) {
      dscale += (double)dlogits[i] * c.cosine[i];
      dcos[i] = static_cast<T>(dlogits[i] * scale);
    }
    if (w.dlog_scale) w.dlog_scale[0] += static_cast<T>(dscale * scale);
    std::vector<T> dproj((size_t)N * de), dunit((size_t)E * de), dh((size_t)N * de, T(0));
    gemm<T>(false, false, N, de, E, T(1), dcos.data(), E, c.expert_unit.data(), de, T(0), dproj.data(), de);
    gemm<T>(true, false, E, de, N, T(1), dcos.data(), E, c.proj.data(), de, T(0), dunit.data(), de);
    unit_rows_backward(dh.data(), dproj.data(), c.proj, c.proj_norm, N, de);
    if (w.dexperts) unit_rows_backward(w.dexperts, dunit.data(), c.expert_unit, c.expert_norm, E, de);
    linear_backward(dxn, w.dgate, dh.data(), xn, w.gate, N, d, de);
    return;
  }
  linear_backward(dxn, w.dgate, dlogits.data(), xn, w.gate, N, d, E);
  if (c.noisy) {
    // H = clean + eps * softplus(raw): d raw = dH * eps * sigmoid(raw).
    std::vector<T> draw((size_t)N * E);
    for (size_t i = 0; i < draw.size(); ++i)
      draw[i] = static_cast<T>(dlogits[i] * c.noise[i] * sigmoid(c.noise_raw[i]));
    linear_backward(dxn, w.dnoise, draw.data(), xn, w.noise, N, d, E);
  }
}

template <typename T>
void router_backward_dispatch(T* dxn, const RouterWeights<T>& w, const RouterCache<T>& c, const T* dsource,
                              const T* xn, const ModelConfig& cfg, const RouterCall& call) {
  XD_CHECK(router_mixes_tokens(cfg) && dxn);
  soft_moe_backward_dispatch(dxn, w, c, dsource, xn, cfg, call);
}

#define XD_INSTANTIATE_ROUTER(T)                                                                               \
  template void router_forward<T>(RouterCache<T>*, DispatchPlan<T>*, const T*, const RouterWeights<T>&,       \
                                  const ModelConfig&, const RouterCall&);                                      \
  template const T* router_source<T>(const RouterCache<T>&, const T*, const ModelConfig&);                    \
  template void router_backward_combine<T>(T*, const RouterWeights<T>&, const RouterCache<T>&,                \
                                           const DispatchPlan<T>&, const std::vector<T>&, const T*,           \
                                           const ModelConfig&, const RouterCall&, double);                     \
  template void router_backward_dispatch<T>(T*, const RouterWeights<T>&, const RouterCache<T>&, const T*,     \
                                            const T*, const ModelConfig&, const RouterCall&);
XD_INSTANTIATE_ROUTER(float)
XD_INSTANTIATE_ROUTER(double)

}  // namespace xd
