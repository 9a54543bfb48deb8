// int4_row: each row as 4-bit integers on one f32 scale, for tensors whose
// every entry matters a little (replica gradients with error feedback) at
// half of int8_row's bytes.
//
// Layout (compression/codec_format.h, int4_row): rows x f32 scale, then per
// row ceil(cols / 2) bytes; entry c of a row is the low nibble of byte c / 2
// when c is even, the high nibble when odd. A nibble holds q + 8 with q in
// [-7, 7] (so 1..15), x = q * scale, scale = max |x| of the row / 7 (0 for
// an all-zero row). The unused high nibble of an odd row's last byte is 0.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace xd::detail {

// The payload's size for rows x cols entries.
inline uint64_t int4_row_bytes(uint64_t rows, uint64_t cols) { return 4 * rows + rows * ((cols + 1) / 2); }

// Writes the payload of x (finite) to out[0, int4_row_bytes).
void encode_int4_rows(const float* x, uint64_t rows, uint64_t cols, uint8_t* out);

// Decodes in[0, int4_row_bytes) into out[0, rows * cols). A scale that is
// not finite or negative, a value nibble of 0, or a set padding nibble is
// corruption: no encoder writes them.
Status decode_int4_rows(const uint8_t* in, uint64_t rows, uint64_t cols, float* out);

}  // namespace xd::detail
