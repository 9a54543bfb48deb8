#include "model/swiglu_expert.h"

#include "model/ops.h"

namespace xd {

template <typename T>
void swiglu_expert_forward(T* out, ExpertCache<T>* c, const T* in, const ExpertParams<T>& p,
                           int n, int d, int ff) {
  const size_t m = (size_t)n * ff;
  c->h1.resize(m);
  c->h3.resize(m);
  c->gated.resize(m);
  if (n == 0) return;
  linear_forward(c->h1.data(), in, p.w1, n, d, ff);
  linear_forward(c->h3.data(), in, p.w3, n, d, ff);
  swiglu_forward(c->gated.data(), c->h1.data(), c->h3.data(), (int64_t)m);
  linear_forward(out, c->gated.data(), p.w2, n, ff, d);
}

template <typename T>
void swiglu_expert_backward(T* din, const T* dout, const T* in, const ExpertCache<T>& c,
                            const ExpertParams<T>& p, int n, int d, int ff) {
  if (n == 0) return;
  const size_t m = (size_t)n * ff;
  std::vector<T> dgated(m, T(0)), dh1(m, T(0)), dh3(m, T(0));
  linear_backward(dgated.data(), p.dw2, dout, c.gated.data(), p.w2, n, ff, d);
  swiglu_backward(dh1.data(), dh3.data(), dgated.data(), c.h1.data(), c.h3.data(), (int64_t)m);
  linear_backward(din, p.dw1, dh1.data(), in, p.w1, n, d, ff);
  linear_backward(din, p.dw3, dh3.data(), in, p.w3, n, d, ff);
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
