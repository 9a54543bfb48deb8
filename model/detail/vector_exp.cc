#include "model/detail/vector_exp.h"

namespace xd::detail {

namespace {

template <class V>
[[gnu::always_inline]] inline void exp_shifted_lanes(float* out, const float* in, const V& shift) {
  V x, e;
  std::memcpy(&x, in, sizeof x);
  x = x - shift;
  exp_v(e, x);
  std::memcpy(out, &e, sizeof e);
}

template <class V>
[[gnu::always_inline]] inline void exp_shifted_loop(float* out, const float* in, size_t n, float shift) {
  constexpr size_t L = sizeof(V) / sizeof(float);
  const V s = V{} + shift;
  size_t i = 0;
  for (; i + L <= n; i += L) exp_shifted_lanes(out + i, in + i, s);
  if (const size_t k = n - i) {  // the tail through padded lanes
    float o[L] = {}, a[L] = {};
    std::memcpy(a, in + i, k * sizeof(float));
    exp_shifted_lanes(o, a, s);
    std::memcpy(out + i, o, k * sizeof(float));
  }
}

#ifdef XD_VECTOR_AVX2
__attribute__((target("avx2,fma"))) void exp_shifted_avx2(float* out, const float* in, size_t n, float shift) {
  exp_shifted_loop<f32x8>(out, in, n, shift);
}
#endif

}  // namespace

#ifdef XD_VECTOR_AVX2
bool have_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

double exp_shifted_sum(float* out, const float* in, size_t n, float shift) {
#ifdef XD_VECTOR_AVX2
  if (have_avx2_fma())
    exp_shifted_avx2(out, in, n, shift);
  else
#endif
    exp_shifted_loop<f32x4>(out, in, n, shift);
  // Four chains of additions overlap; their order is fixed, so the sum is
  // the same bits on every call.
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += out[i];
    s1 += out[i + 1];
    s2 += out[i + 2];
    s3 += out[i + 3];
  }
  for (; i < n; ++i) s0 += out[i];
  return (s0 + s1) + (s2 + s3);
}

}  // namespace xd::detail
