// Whole arrays of f32 <-> bf16 (round to nearest even, NaN kept a NaN), for
// code outside the codecs that puts bf16 on the wire itself (the dense-gradient
// all-reduce). The same conversion as the bf16 codec. Pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace xd {

void floats_to_bf16(const float* in, size_t n, uint16_t* out);
// The same, adding in the same pass the rounding's squared error
// sum (x - bf16(x))^2 to *error and sum x^2 to *signal, over the finite
// values (NaN and Inf cross as they are): what a bf16 wire loses.
void floats_to_bf16(const float* in, size_t n, uint16_t* out, double* error, double* signal);
void bf16_to_floats(const uint16_t* in, size_t n, float* out);

}  // namespace xd
