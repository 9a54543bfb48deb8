// int8_row and int4_row: each row as small integers on fp32 scales, for
// tensors whose every entry matters a little (replica gradients with error
// feedback). int4_row spends half of int8_row's bytes on the values.
//
// A row is cut into scale blocks of `block` entries (0: the whole row is one
// block; the last block of a row is shorter when `block` does not divide
// cols). Each block has its own scale, its largest magnitude over the
// integer range (127 or 7; 0 for an all-zero block), so one large entry
// coarsens only its block: gradient rows are heavy-tailed, and with one scale
// for a whole tensor most of its entries round to zero.
//
// Layout (compression/codec_format.h): rows x scale_blocks(cols, block) f32
// scales, row-major, then the values.
//   int8_row: rows x cols int8, q in [-127, 127], x = q * scale (no encoder
//     writes -128; a decoder takes it as -128 * scale).
//   int4_row: per row ceil(cols / 2) bytes; entry c of a row is the low
//     nibble of byte c / 2 when c is even, the high nibble when odd. A nibble
//     holds q + 8 with q in [-7, 7] (so 1..15), x = q * scale. The unused
//     high nibble of an odd row's last byte is 0.
// On x86-64 the encoders find each block's largest magnitude and quantize,
// and int4_row decodes, 16 entries at a time (SSE2), with the bytes and
// floats of the scalar loops they fall back to elsewhere and in tails (the
// tests compare both with a reference).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace xd::detail {

// Scales per row: 1 for block 0 (the whole row), else ceil(cols / block).
inline uint64_t scale_blocks(uint64_t cols, uint64_t block) { return block == 0 ? 1 : (cols + block - 1) / block; }

// The payload sizes for rows x cols entries (block <= kMaxCodecBlock and
// rows, cols, rows * cols <= 2^34 keep these from overflowing).
inline uint64_t int8_row_bytes(uint64_t rows, uint64_t cols, uint64_t block) {
  return 4 * rows * scale_blocks(cols, block) + rows * cols;
}
inline uint64_t int4_row_bytes(uint64_t rows, uint64_t cols, uint64_t block) {
  return 4 * rows * scale_blocks(cols, block) + rows * ((cols + 1) / 2);
}

// Write the payload of x (finite) to out[0, int*_row_bytes).
void encode_int8_rows(const float* x, uint64_t rows, uint64_t cols, uint64_t block, uint8_t* out);
void encode_int4_rows(const float* x, uint64_t rows, uint64_t cols, uint64_t block, uint8_t* out);

// Decode in[0, int*_row_bytes) into out[0, rows * cols). A scale that is not
// finite or negative is corruption, and for int4_row a value nibble of 0 or a
// set padding nibble: no encoder writes them.
Status decode_int8_rows(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, float* out);
Status decode_int4_rows(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, float* out);

}  // namespace xd::detail
