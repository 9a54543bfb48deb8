#include "model/gate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/check.h"
#include "model/ops.h"

namespace xd {

namespace {

bool is_token_choice(Gating g) { return g != Gating::kExpertChoice; }
bool is_sigmoid(Gating g) { return g == Gating::kSigmoidTopK; }

// Indices of the `k` largest of `values` (stride apart), ties to the lower index.
template <typename T>
void top_indices(std::vector<int>* idx, const T* values, int n, int stride, int k) {
  idx->resize(n);
  std::iota(idx->begin(), idx->end(), 0);
  std::partial_sort(idx->begin(), idx->begin() + k, idx->end(), [&](int a, int b) {
    T va = values[(size_t)a * stride], vb = values[(size_t)b * stride];
    return va > vb || (va == vb && a < b);
  });
  idx->resize(k);
}

}  // namespace

template <typename T>
void gate_forward(DispatchPlan<T>* plan, GateCache<T>* cache, const T* logits,
                  const ModelConfig& cfg, int num_tokens) {
  const int N = num_tokens, E = cfg.num_experts, k = cfg.top_k;
  GateCache<T>& c = *cache;
  c.num_tokens = N;
  c.logits.assign(logits, logits + (size_t)N * E);
  c.scores.resize((size_t)N * E);
  std::vector<T> probs((size_t)N * E);
  double z = 0;
  for (int i = 0; i < N; ++i) {
    double lse = softmax_row(&probs[(size_t)i * E], logits + (size_t)i * E, E);
    z += lse * lse;
  }
  c.z_loss = N > 0 ? z / N : 0.0;
  if (is_sigmoid(cfg.gating)) {
    for (size_t j = 0; j < c.scores.size(); ++j)
      c.scores[j] = static_cast<T>(1.0 / (1.0 + std::exp(-(double)logits[j])));
  } else {
    c.scores = probs;
  }

  const int capacity = expert_capacity(cfg, N);
  std::vector<RouteAssignment<T>> kept;
  std::vector<int> taken(E, 0);
  c.balance_prob.assign(E, 0.0);
  c.balance_frac.assign(E, 0.0);
  c.aux_loss = 0;
  plan->dropped = 0;
  std::vector<int> idx;
  if (is_token_choice(cfg.gating)) {
    c.chosen.resize((size_t)N * k);
    c.norm.resize(N);
    for (int i = 0; i < N; ++i) {
      const T* s = &c.scores[(size_t)i * E];
      top_indices(&idx, s, E, 1, k);
      double z_i = 0;
      for (int j = 0; j < k; ++j) z_i += s[idx[j]];
      c.norm[i] = z_i;
      for (int j = 0; j < k; ++j) {
        int e = idx[j];
        c.chosen[(size_t)i * k + j] = e;
        c.balance_frac[e] += 1.0 / ((double)N * k);
        if (taken[e] < capacity) {
          ++taken[e];
          kept.push_back({e, i, i, static_cast<T>(s[e] / z_i)});
        } else {
          ++plan->dropped;
        }
      }
      // P_e: router probability mass; sigmoid scores are normalised per token first.
      double row_sum = 0;
      for (int e = 0; e < E; ++e) row_sum += s[e];
      const bool normalise = is_sigmoid(cfg.gating);
      for (int e = 0; e < E; ++e) c.balance_prob[e] += (normalise ? s[e] / row_sum : s[e]) / N;
    }
    for (int e = 0; e < E; ++e) c.aux_loss += E * c.balance_frac[e] * c.balance_prob[e];
  } else {
    c.chosen.clear();
    for (int e = 0; e < E; ++e) {
      top_indices(&idx, &c.scores[e], N, E, std::min(capacity, N));
      std::sort(idx.begin(), idx.end());
      for (int i : idx) kept.push_back({e, i, i, c.scores[(size_t)i * E + e]});
    }
  }

  order_plan(plan, kept, N, E);
}

template <typename T>
void gate_backward(T* dlogits, const std::vector<T>& dweight, const DispatchPlan<T>& plan,
                   const GateCache<T>& c, const ModelConfig& cfg, double loss_scale) {
  const int N = c.num_tokens, E = cfg.num_experts, k = cfg.top_k;
  XD_CHECK((int)dweight.size() == plan.size());
  std::vector<double> dscore((size_t)N * E, 0.0);
  for (int e = 0; e < E; ++e)
    for (int a = plan.expert_offsets[e]; a < plan.expert_offsets[e + 1]; ++a) {
      const int i = plan.token[a];
      const double dw = dweight[a];
      if (!is_token_choice(cfg.gating)) {
        dscore[(size_t)i * E + e] += dw;
        continue;
      }
      // w_e = s_e / Z with Z = sum of the chosen scores of token i.
      const double Z = c.norm[i], s_e = c.scores[(size_t)i * E + e];
      dscore[(size_t)i * E + e] += dw / Z;
      for (int j = 0; j < k; ++j) dscore[(size_t)i * E + c.chosen[(size_t)i * k + j]] -= dw * s_e / (Z * Z);
    }

  if (is_token_choice(cfg.gating) && cfg.aux_loss_coef > 0) {
    for (int i = 0; i < N; ++i) {
      const T* s = &c.scores[(size_t)i * E];
      if (!is_sigmoid(cfg.gating)) {
        for (int e = 0; e < E; ++e)
          dscore[(size_t)i * E + e] += cfg.aux_loss_coef * E * c.balance_frac[e] / N;
      } else {
        double S = 0, gq = 0;
        for (int e = 0; e < E; ++e) S += s[e];
        for (int e = 0; e < E; ++e) gq += cfg.aux_loss_coef * E * c.balance_frac[e] / N * s[e] / S;
        for (int e = 0; e < E; ++e)
          dscore[(size_t)i * E + e] += (cfg.aux_loss_coef * E * c.balance_frac[e] / N - gq) / S;
      }
    }
  }

  std::vector<T> probs(E);
  for (int i = 0; i < N; ++i) {
    const T* s = &c.scores[(size_t)i * E];
    double* ds = &dscore[(size_t)i * E];
    T* dl = dlogits + (size_t)i * E;
    if (is_sigmoid(cfg.gating)) {
      for (int e = 0; e < E; ++e) dl[e] += static_cast<T>(loss_scale * ds[e] * s[e] * (1.0 - s[e]));
    } else {
      double dot = 0;
      for (int e = 0; e < E; ++e) dot += ds[e] * s[e];
      for (int e = 0; e < E; ++e) dl[e] += static_cast<T>(loss_scale * s[e] * (ds[e] - dot));
    }
    if (cfg.z_loss_coef > 0) {
      double lse = softmax_row(probs.data(), &c.logits[(size_t)i * E], E);
      for (int e = 0; e < E; ++e)
        dl[e] += static_cast<T>(loss_scale * cfg.z_loss_coef * 2.0 * lse * probs[e] / N);
    }
  }
}

template void gate_forward<float>(DispatchPlan<float>*, GateCache<float>*, const float*,
                                  const ModelConfig&, int);
template void gate_forward<double>(DispatchPlan<double>*, GateCache<double>*, const double*,
                                   const ModelConfig&, int);
template void gate_backward<float>(float*, const std::vector<float>&, const DispatchPlan<float>&,
                                   const GateCache<float>&, const ModelConfig&, double);
template void gate_backward<double>(double*, const std::vector<double>&,
                                    const DispatchPlan<double>&, const GateCache<double>&,
                                    const ModelConfig&, double);

}  // namespace xd
