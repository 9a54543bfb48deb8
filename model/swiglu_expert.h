// SwiGLU expert MLP on a batch of token rows: y = w2(silu(w1 x) * w3 x)
// (HF Mixtral MixtralBlockSparseTop2MLP). Forward fills the cache the backward
// needs; backward accumulates into dx, dw1, dw3, dw2. The gate is fused (one
// sigmoid per element, kept for the backward) on top of six BLAS GEMMs; the
// unfused ops (swiglu_forward/backward in ops.h) are the reference the tests
// compare it with. Thread-safe for distinct caches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace xd {

template <typename T>
struct ExpertParams {
  const T* w1;  // (ff, d)
  const T* w3;  // (ff, d)
  const T* w2;  // (d, ff)
  T* dw1;       // (ff, d) gradients, accumulated
  T* dw3;
  T* dw2;
};

template <typename T>
struct ExpertCache {
  std::vector<T> h1, h3, gated;  // (n, ff) each
  std::vector<T> sigmoid;        // (n, ff) sigmoid(h1), so backward needs no exp
  // Backward scratch, kept to avoid an allocation per call.
  mutable std::vector<T> scratch_a, scratch_b;  // (n, ff)
};

template <typename T>
void swiglu_expert_forward(T* out, ExpertCache<T>* cache, const T* in, const ExpertParams<T>& p,
                           int n, int d, int ff);
// The backward in two halves, so a caller can send din before it computes
// the weight gradients: the input half fills the cache's scratch, which the
// weights half reads (same cache, same dout, in that order).
template <typename T>
void swiglu_expert_backward_input(T* din, const T* dout, const T* in, const ExpertCache<T>& cache,
                                  const ExpertParams<T>& p, int n, int d, int ff);
template <typename T>
void swiglu_expert_backward_weights(const T* dout, const T* in, const ExpertCache<T>& cache,
                                    const ExpertParams<T>& p, int n, int d, int ff);
// Both halves.
template <typename T>
void swiglu_expert_backward(T* din, const T* dout, const T* in, const ExpertCache<T>& cache,
                            const ExpertParams<T>& p, int n, int d, int ff);

}  // namespace xd
