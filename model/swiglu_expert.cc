#include "model/swiglu_expert.h"

#include <cmath>
#include <cstring>

#include "model/detail/vector_exp.h"
#include "model/gemm.h"
#include "model/ops.h"

namespace xd {

namespace {
inline double sigmoid_of(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The float gate, SIMD at plain -O2: scalar loops cost ~3 ns per (n, ff)
// element in the forward (one libm expf + a divide), which at d = 128 is a
// third of the forward GEMM time. exp is model/detail/vector_exp.h's (sigmoid
// within 1.5e-7 relative on [-80, 80]): 4 lanes at baseline SSE2, 8 lanes in
// a target("avx2,fma") copy picked once at run time.
using detail::f32x4;
using detail::f32x8;

// s = 1 / (1 + exp(-x)), lane-wise.
template <class V>
[[gnu::always_inline]] inline void sigmoid_v(V& s, const V& x) {
  const V t = -x;
  V e;
  detail::exp_v(e, t);
  s = 1.0f / (1.0f + e);
}

// sig = sigmoid(h1), gated = h1 * sig * h3 over m elements (tail via padded lanes).
template <class V>
[[gnu::always_inline]] inline void gate_fwd_loop(float* sig, float* gated, const float* h1,
                                                 const float* h3, size_t m) {
  constexpr size_t L = sizeof(V) / sizeof(float);
  auto lanes = [](float* so, float* go, const float* a, const float* b) {
    V x, y, s;
    std::memcpy(&x, a, sizeof x);
    std::memcpy(&y, b, sizeof y);
    sigmoid_v(s, x);
    const V g = x * s * y;
    std::memcpy(so, &s, sizeof s);
    std::memcpy(go, &g, sizeof g);
  };
  size_t i = 0;
  for (; i + L <= m; i += L) lanes(sig + i, gated + i, h1 + i, h3 + i);
  if (const size_t k = m - i) {
    float so[L] = {}, go[L] = {}, a[L] = {}, b[L] = {};
    std::memcpy(a, h1 + i, k * sizeof(float));
    std::memcpy(b, h3 + i, k * sizeof(float));
    lanes(so, go, a, b);
    std::memcpy(sig + i, so, k * sizeof(float));
    std::memcpy(gated + i, go, k * sizeof(float));
  }
}

// dh1 (holding d(gated) on entry) -> d(h1); dh3 = d(gated) * h1 * sig.
template <class V>
[[gnu::always_inline]] inline void gate_bwd_loop(float* dh1, float* dh3, const float* h1,
                                                 const float* h3, const float* sig, size_t m) {
  constexpr size_t L = sizeof(V) / sizeof(float);
  auto lanes = [](float* d1, float* d3, const float* a, const float* b, const float* sp) {
    V dg, x, y, s;
    std::memcpy(&dg, d1, sizeof dg);
    std::memcpy(&x, a, sizeof x);
    std::memcpy(&y, b, sizeof y);
    std::memcpy(&s, sp, sizeof s);
    const V o3 = dg * x * s;
    const V o1 = dg * y * s * (1.0f + x * (1.0f - s));
    std::memcpy(d3, &o3, sizeof o3);
    std::memcpy(d1, &o1, sizeof o1);
  };
  size_t i = 0;
  for (; i + L <= m; i += L) lanes(dh1 + i, dh3 + i, h1 + i, h3 + i, sig + i);
  if (const size_t k = m - i) {
    float d1[L] = {}, d3[L] = {}, a[L] = {}, b[L] = {}, sp[L] = {};
    std::memcpy(d1, dh1 + i, k * sizeof(float));
    std::memcpy(a, h1 + i, k * sizeof(float));
    std::memcpy(b, h3 + i, k * sizeof(float));
    std::memcpy(sp, sig + i, k * sizeof(float));
    lanes(d1, d3, a, b, sp);
    std::memcpy(dh1 + i, d1, k * sizeof(float));
    std::memcpy(dh3 + i, d3, k * sizeof(float));
  }
}

#ifdef XD_VECTOR_AVX2
__attribute__((target("avx2,fma"))) void gate_fwd_avx2(float* s, float* g, const float* a,
                                                       const float* b, size_t m) {
  gate_fwd_loop<f32x8>(s, g, a, b, m);
}
__attribute__((target("avx2,fma"))) void gate_bwd_avx2(float* d1, float* d3, const float* a,
                                                       const float* b, const float* s,
                                                       size_t m) {
  gate_bwd_loop<f32x8>(d1, d3, a, b, s, m);
}
#endif

void gate_fwd(float* sig, float* gated, const float* h1, const float* h3, size_t m) {
#ifdef XD_VECTOR_AVX2
  if (detail::have_avx2_fma()) return gate_fwd_avx2(sig, gated, h1, h3, m);
#endif
  gate_fwd_loop<f32x4>(sig, gated, h1, h3, m);
}

void gate_bwd(float* dh1, float* dh3, const float* h1, const float* h3, const float* sig,
              size_t m) {
#ifdef XD_VECTOR_AVX2
  if (detail::have_avx2_fma()) return gate_bwd_avx2(dh1, dh3, h1, h3, sig, m);
#endif
  gate_bwd_loop<f32x4>(dh1, dh3, h1, h3, sig, m);
}

// The double path (gradient checks): plain loops, libm exp.
void gate_fwd(double* sig, double* g, const double* h1, const double* h3, size_t m) {
  for (size_t i = 0; i < m; ++i) {
    const double s = sigmoid_of(h1[i]);
    sig[i] = s;
    g[i] = h1[i] * s * h3[i];
  }
}

void gate_bwd(double* dh1, double* dh3, const double* h1, const double* h3, const double* sig,
              size_t m) {
  for (size_t i = 0; i < m; ++i) {
    const double dg = dh1[i], s = sig[i], a = h1[i];
    dh3[i] = dg * a * s;                                // d/d(h3) of silu(h1) * h3
    dh1[i] = dg * h3[i] * s * (1.0 + a * (1.0 - s));  // silu'(h1) = s (1 + h1 (1 - s))
  }
}
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
  gate_fwd(c->sigmoid.data(), c->gated.data(), c->h1.data(), c->h3.data(), m);
  linear_forward(out, c->gated.data(), p.w2, n, ff, d);
}

template <typename T>
void swiglu_expert_backward_input(T* din, const T* dout, const T* in, const ExpertCache<T>& c,
                                  const ExpertParams<T>& p, int n, int d, int ff) {
  if (n == 0) return;
  const size_t m = (size_t)n * ff;
  c.scratch_a.resize(m);
  c.scratch_b.resize(m);
  T* dh1 = c.scratch_a.data();  // holds d(gated) first
  T* dh3 = c.scratch_b.data();
  // d(gated) = dout W2 (overwrite).
  gemm<T>(false, false, n, ff, d, T(1), dout, d, p.w2, ff, T(0), dh1, ff);
  gate_bwd(dh1, dh3, c.h1.data(), c.h3.data(), c.sigmoid.data(), m);
  linear_backward<T>(din, nullptr, dh1, in, p.w1, n, d, ff);
  linear_backward<T>(din, nullptr, dh3, in, p.w3, n, d, ff);
}

template <typename T>
void swiglu_expert_backward_weights(const T* dout, const T* in, const ExpertCache<T>& c,
                                    const ExpertParams<T>& p, int n, int d, int ff) {
  if (n == 0) return;
  // dW2 += dout^T gated; dW1 += dh1^T in; dW3 += dh3^T in.
  gemm<T>(true, false, d, ff, n, T(1), dout, d, c.gated.data(), ff, T(1), p.dw2, ff);
  linear_backward<T>(nullptr, p.dw1, c.scratch_a.data(), in, p.w1, n, d, ff);
  linear_backward<T>(nullptr, p.dw3, c.scratch_b.data(), in, p.w3, n, d, ff);
}

template <typename T>
void swiglu_expert_backward(T* din, const T* dout, const T* in, const ExpertCache<T>& c,
                            const ExpertParams<T>& p, int n, int d, int ff) {
  swiglu_expert_backward_input(din, dout, in, c, p, n, d, ff);
  swiglu_expert_backward_weights(dout, in, c, p, n, d, ff);
}

template void swiglu_expert_forward<float>(float*, ExpertCache<float>*, const float*,
                                           const ExpertParams<float>&, int, int, int);
template void swiglu_expert_forward<double>(double*, ExpertCache<double>*, const double*,
                                            const ExpertParams<double>&, int, int, int);
template void swiglu_expert_backward_input<float>(float*, const float*, const float*,
                                                  const ExpertCache<float>&, const ExpertParams<float>&,
                                                  int, int, int);
template void swiglu_expert_backward_input<double>(double*, const double*, const double*,
                                                   const ExpertCache<double>&, const ExpertParams<double>&,
                                                   int, int, int);
template void swiglu_expert_backward_weights<float>(const float*, const float*, const ExpertCache<float>&,
                                                    const ExpertParams<float>&, int, int, int);
template void swiglu_expert_backward_weights<double>(const double*, const double*, const ExpertCache<double>&,
                                                     const ExpertParams<double>&, int, int, int);
template void swiglu_expert_backward<float>(float*, const float*, const float*,
                                            const ExpertCache<float>&, const ExpertParams<float>&,
                                            int, int, int);
template void swiglu_expert_backward<double>(double*, const double*, const double*,
                                             const ExpertCache<double>&,
                                             const ExpertParams<double>&, int, int, int);

}  // namespace xd
