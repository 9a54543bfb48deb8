#include "model/swiglu_expert.h"

#include <cmath>

#include "model/gemm.h"
#include "model/ops.h"

namespace xd {

namespace {
inline float sigmoid_of(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline double sigmoid_of(double x) { return 1.0 / (1.0 + std::exp(-x)); }
}  // namespace

template <typename T>
void swiglu_expert_forward(T* out, ExpertCache<T>* c, const T* in, const ExpertParams<T>& p,
                           int n, int d, int ff) {
  const size_t m = (size_t)n * ff;
  c->h1.resize(m);
  c->h3.resize(m);
  c->gated.resize(m);
  c->sigmoid.resize(m);
  if (n == 0) return;
  linear_forward(c->h1.data(), in, p.w1, n, d, ff);
  linear_forward(c->h3.data(), in, p.w3, n, d, ff);
  const T* h1 = c->h1.data();
  const T* h3 = c->h3.data();
  T* sig = c->sigmoid.data();
  T* g = c->gated.data();
  for (size_t i = 0; i < m; ++i) {
    const T s = sigmoid_of(h1[i]);
    sig[i] = s;
    g[i] = h1[i] * s * h3[i];
  }
  linear_forward(out, c->gated.data(), p.w2, n, ff, d);
}

template <typename T>
void swiglu_expert_backward(T* din, const T* dout, const T* in, const ExpertCache<T>& c,
                            const ExpertParams<T>& p, int n, int d, int ff) {
  if (n == 0) return;
  const size_t m = (size_t)n * ff;
  c.scratch_a.resize(m);
  c.scratch_b.resize(m);
  T* dh1 = c.scratch_a.data();  // holds d(gated) first
  T* dh3 = c.scratch_b.data();
  // d(gated) = dout W2 (overwrite); dW2 += dout^T gated.
  gemm<T>(false, false, n, ff, d, T(1), dout, d, p.w2, ff, T(0), dh1, ff);
  gemm<T>(true, false, d, ff, n, T(1), dout, d, c.gated.data(), ff, T(1), p.dw2, ff);
  const T* h1 = c.h1.data();
  const T* h3 = c.h3.data();
  const T* sig = c.sigmoid.data();
  for (size_t i = 0; i < m; ++i) {
    const T dg = dh1[i], s = sig[i], a = h1[i];
    dh3[i] = dg * a * s;                                // d/d(h3) of silu(h1) * h3
    dh1[i] = dg * h3[i] * s * (T(1) + a * (T(1) - s));  // silu'(h1) = s (1 + h1 (1 - s))
  }
  linear_backward(din, p.dw1, dh1, in, p.w1, n, d, ff);
  linear_backward(din, p.dw3, dh3, in, p.w3, n, d, ff);
}

template void swiglu_expert_forward<float>(float*, ExpertCache<float>*, const float*,
                                           const ExpertParams<float>&, int, int, int);
template void swiglu_expert_forward<double>(double*, ExpertCache<double>*, const double*,
                                            const ExpertParams<double>&, int, int, int);
template void swiglu_expert_backward<float>(float*, const float*, const float*,
                                            const ExpertCache<float>&, const ExpertParams<float>&,
                                            int, int, int);
template void swiglu_expert_backward<double>(double*, const double*, const double*,
                                             const ExpertCache<double>&,
                                             const ExpertParams<double>&, int, int, int);

}  // namespace xd
