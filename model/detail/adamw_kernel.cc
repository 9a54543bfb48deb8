#include "model/detail/adamw_kernel.h"

#include <cmath>
#include <cstring>

#include "model/detail/vector_exp.h"

namespace xd::detail {

namespace {

// One element, in the order every path keeps.
[[gnu::always_inline]] inline void update_one(float* p, float* g, float* m, float* v, bool decay,
                                              const AdamWFloatStep& s) {
  const float gc = *g * s.clip;
  const float mn = s.beta1 * *m + s.one_minus_beta1 * gc;
  const float vn = s.beta2 * *v + s.one_minus_beta2 * (gc * gc);
  float pn = decay ? *p * s.decay_factor : *p;
  const float denom = std::sqrt(vn) * s.inv_sqrt_c2 + s.eps;
  pn = pn - (s.step_size * mn) / denom;
  *g = gc;
  *m = mn;
  *v = vn;
  *p = pn;
}

// L elements at once, the same operations lane by lane as update_one, in
// two halves around the square root (a builtin of the caller's target).
// Vectors go by reference, as in vector_exp.h (no vector-ABI by-value passing).
template <class V>
[[gnu::always_inline]] inline void moments_lanes(float* g, float* m, float* v, const AdamWFloatStep& s, V& mv,
                                                 V& vv) {
  V gv;
  std::memcpy(&gv, g, sizeof gv);
  std::memcpy(&mv, m, sizeof mv);
  std::memcpy(&vv, v, sizeof vv);
  const V zero = {};
  gv = gv * (zero + s.clip);
  mv = (zero + s.beta1) * mv + (zero + s.one_minus_beta1) * gv;
  vv = (zero + s.beta2) * vv + (zero + s.one_minus_beta2) * (gv * gv);
  std::memcpy(g, &gv, sizeof gv);
  std::memcpy(m, &mv, sizeof mv);
  std::memcpy(v, &vv, sizeof vv);
}

template <class V>
[[gnu::always_inline]] inline void weights_lanes(float* p, bool decay, const AdamWFloatStep& s, const V& mv,
                                                 const V& root) {
  V pv;
  std::memcpy(&pv, p, sizeof pv);
  const V zero = {};
  if (decay) pv = pv * (zero + s.decay_factor);
  const V denom = root * (zero + s.inv_sqrt_c2) + s.eps;
  pv = pv - ((zero + s.step_size) * mv) / denom;
  std::memcpy(p, &pv, sizeof pv);
}

#ifdef XD_VECTOR_AVX2
// "avx2" without "fma": no multiply-add may be fused, so the bits stay those
// of the portable path.
__attribute__((target("avx2"))) void update_avx2(float* p, float* g, float* m, float* v, size_t n, bool decay,
                                                 const AdamWFloatStep& s) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x8 mv, vv;
    moments_lanes(g + i, m + i, v + i, s, mv, vv);
    const f32x8 root = __builtin_ia32_sqrtps256(vv);
    weights_lanes(p + i, decay, s, mv, root);
  }
  for (; i < n; ++i) update_one(p + i, g + i, m + i, v + i, decay, s);
}
#endif

}  // namespace

// update_avx2's loop on 4 lanes. The two are written out: each square-root
// builtin must sit in a function compiled for its own target.
void adamw_float_span_portable(float* p, float* g, float* m, float* v, size_t n, bool decay,
                               const AdamWFloatStep& s) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    f32x4 mv, vv;
    moments_lanes(g + i, m + i, v + i, s, mv, vv);
    const f32x4 root = __builtin_ia32_sqrtps(vv);
    weights_lanes(p + i, decay, s, mv, root);
  }
  for (; i < n; ++i) update_one(p + i, g + i, m + i, v + i, decay, s);
}

void adamw_float_span(float* p, float* g, float* m, float* v, size_t n, bool decay, const AdamWFloatStep& s) {
#ifdef XD_VECTOR_AVX2
  if (have_avx2_fma()) {
    update_avx2(p, g, m, v, n, decay, s);
    return;
  }
#endif
  adamw_float_span_portable(p, g, m, v, n, decay, s);
}

}  // namespace xd::detail
