// Lane-wise float exp on GCC/Clang vector types, at plain -O2 (no
// -ffast-math, no -march), and the softmax kernel built on it.
//
// exp is Cephes expf: round(t / ln 2) by the magic-number trick, a degree-5
// polynomial of the remainder, 2^k from exponent bits; within 2e-7 relative
// on [-86, 86]. The argument is clamped to +-86 so nothing goes subnormal:
// anything below gives exp(-86) (about 4e-38), not 0. NaN stays NaN. The
// helpers take vectors by reference (no vector-ABI by-value passing) and are
// always inlined, so each loop compiles for the target of the function it
// lands in (baseline SSE2, or a target("avx2,fma") copy picked at run time).
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstring>

namespace xd::detail {

typedef float f32x4 __attribute__((vector_size(16)));
typedef int i32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int i32x8 __attribute__((vector_size(32)));
template <class V> struct IntVec;
template <> struct IntVec<f32x4> { using type = i32x4; };
template <> struct IntVec<f32x8> { using type = i32x8; };

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
// A target("avx2,fma") copy of a loop can be picked at run time.
#define XD_VECTOR_AVX2 1
// Whether this CPU runs such copies; asked once, then cached.
bool have_avx2_fma();
#endif

// e = exp(x), lane-wise.
template <class V>
[[gnu::always_inline]] inline void exp_v(V& e, const V& x) {
  using VI = typename IntVec<V>::type;
  const V zero = {};
  const V lo = zero - 86.0f, hi = zero + 86.0f, magic = zero + 12582912.0f;  // 1.5 * 2^23
  V t = x;
  t = t < lo ? lo : t;
  t = t > hi ? hi : t;
  V kf = t * 1.44269504088896341f + magic;  // round(t / ln 2) in the low mantissa bits
  VI k, kmagic;  // bit patterns (memcpy: std::bit_cast would pass vectors by value)
  std::memcpy(&k, &kf, sizeof k);
  std::memcpy(&kmagic, &magic, sizeof kmagic);
  k = (k - kmagic + 127) << 23;  // 2^k as float bits
  kf -= magic;
  V r = t - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  V p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  V two_k;
  std::memcpy(&two_k, &k, sizeof two_k);
  e = p * two_k;
}

// out[j] = exp(in[j] - shift) for j < n (out may be in); returns the sum of
// out[0, n) in double (four interleaved partial sums, in a fixed order). The
// float softmax and cross-entropy take their exponentials here; the double
// paths keep libm's exp.
double exp_shifted_sum(float* out, const float* in, size_t n, float shift);

}  // namespace xd::detail
