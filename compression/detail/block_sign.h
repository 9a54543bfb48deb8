// The block_sign value codec (compression/codec_format.h): each row cut into
// blocks of B entries; a row keeps the blocks of largest energy (sum of
// squares), and every entry of a kept block travels as one sign bit times
// its row's scale. Which blocks a row keeps costs one bit per block instead
// of an index per entry, so half the blocks cost about half a bit a weight.
// Stateless functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace xd::detail {

inline uint64_t blocks_per_row(uint64_t cols, uint64_t block) { return (cols + block - 1) / block; }

// The exact payload size: rows scales, the block bitmap, `kept` sign bits.
inline uint64_t block_sign_bytes(uint64_t rows, uint64_t cols, uint64_t block, uint64_t kept) {
  return 4 * rows + (rows * blocks_per_row(cols, block) + 7) / 8 + (kept + 7) / 8;
}

// Encodes rows x cols finite floats, keeping ceil(density x blocks) blocks of
// each non-empty row (at least one). Returns the payload; *kept = the entries
// in kept blocks. With `index` and `value`, also the kept entries as the
// decoder gives them (ascending indices).
std::vector<uint8_t> encode_block_sign(const float* x, uint64_t rows, uint64_t cols, uint64_t block, double density,
                                       uint64_t* kept, std::vector<uint32_t>* index, std::vector<float>* value);

// Decodes a payload of exactly block_sign_bytes(rows, cols, block, kept)
// bytes into the kept entries (ascending indices). A bad scale, a bitmap
// whose blocks hold other than `kept` entries, or bits set past the end is
// an error; nothing is read outside `in`.
Status decode_block_sign(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, uint64_t kept,
                         std::vector<uint32_t>* index, std::vector<float>* value);

}  // namespace xd::detail
