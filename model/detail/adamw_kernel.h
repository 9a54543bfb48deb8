// The float AdamW update of one span of elements, on SIMD lanes. AdamW<float>
// runs it; AdamW<double> keeps the plain double loop as the reference
// (tests/model_adamw_test.cc compares the two).
//
// Every path does the same float operations in the same order, each correctly
// rounded (mul, add, div, sqrt; no fused multiply-add), so an element gets the
// same bits on an 8-lane AVX2 copy, a 4-lane SSE2 one or the scalar tail,
// wherever a span starts. Pure functions; thread-safe.
#pragma once

#include <cstddef>

namespace xd::detail {

// One step's constants, in float.
struct AdamWFloatStep {
  float clip = 1;             // multiplies every gradient (global-norm clipping)
  float beta1 = 0, one_minus_beta1 = 0;
  float beta2 = 0, one_minus_beta2 = 0;
  float decay_factor = 1;     // 1 - lr * weight_decay
  float step_size = 0;        // lr / (1 - beta1^t)
  float inv_sqrt_c2 = 1;      // 1 / sqrt(1 - beta2^t)
  float eps = 0;
};

// For each i < n: g = g * clip (written back); m = beta1 m + (1 - beta1) g;
// v = beta2 v + (1 - beta2) g^2; p = p * decay_factor when `decay`; then
// p = p - step_size m / (sqrt(v) inv_sqrt_c2 + eps). AVX2 when the CPU has it.
void adamw_float_span(float* p, float* g, float* m, float* v, size_t n, bool decay, const AdamWFloatStep& s);
// The same on 4-lane vectors and scalars only (a CPU without AVX2); the same bits.
void adamw_float_span_portable(float* p, float* g, float* m, float* v, size_t n, bool decay,
                               const AdamWFloatStep& s);

}  // namespace xd::detail
