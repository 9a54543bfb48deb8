#include "compression/detail/number_formats.h"

#include "compression/bfloat16.h"

#include <immintrin.h>

#include <cmath>

namespace xd::detail {

namespace {

__attribute__((target("avx,f16c"))) void to_fp16_f16c(const float* in, size_t n, uint8_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
  }
  for (; i < n; ++i) {
    const uint16_t h = float_to_fp16(in[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

__attribute__((target("avx,f16c"))) void from_fp16_f16c(const uint8_t* in, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i))));
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    out[i] = fp16_to_float(h);
  }
}

bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}

}  // namespace

void floats_to_fp16(const float* in, size_t n, uint8_t* out) {
  if (has_f16c()) return to_fp16_f16c(in, n, out);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = float_to_fp16(in[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

void fp16_to_floats(const uint8_t* in, size_t n, float* out) {
  if (has_f16c()) return from_fp16_f16c(in, n, out);
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    out[i] = fp16_to_float(h);
  }
}

}  // namespace xd::detail

namespace xd {

void floats_to_bf16(const float* in, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = detail::float_to_bf16(in[i]);
}

void floats_to_bf16(const float* in, size_t n, uint16_t* out, double* error, double* signal) {
  double e = 0, sig = 0;
  for (size_t i = 0; i < n; ++i) {
    out[i] = detail::float_to_bf16(in[i]);
    if (!std::isfinite(in[i])) continue;
    const double d = double(in[i]) - detail::bf16_to_float(out[i]);
    e += d * d;
    sig += double(in[i]) * in[i];
  }
  *error += e;
  *signal += sig;
}

void bf16_to_floats(const uint16_t* in, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = detail::bf16_to_float(in[i]);
}

}  // namespace xd
