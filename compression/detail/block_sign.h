// The block_sign value codec (compression/codec_format.h): each row cut into
// blocks of B entries; a row keeps the blocks of largest energy (sum of
// squares), and every entry of a kept block travels as one sign bit times
// its row's scale. Which blocks a row keeps costs one bit per block instead
// of an index per entry, so half the blocks cost about half a bit a weight.
// Stateless functions; thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/status.h"
#include "compression/codec_format.h"

namespace xd::detail {

inline uint64_t blocks_per_row(uint64_t cols, uint64_t block) { return (cols + block - 1) / block; }

// The exact payload size: rows scales, the block bitmap, `kept` sign bits.
inline uint64_t block_sign_bytes(uint64_t rows, uint64_t cols, uint64_t block, uint64_t kept) {
  return 4 * rows + (rows * blocks_per_row(cols, block) + 7) / 8 + codec_sign_bytes(kept);
}

// Encodes rows x cols finite floats, keeping ceil(density x blocks) blocks of
// each non-empty row (at least one). Returns the payload; *kept = the entries
// in kept blocks. With `index` and `value`, also the kept entries as the
// decoder gives them (ascending indices).
std::vector<uint8_t> encode_block_sign(const float* x, uint64_t rows, uint64_t cols, uint64_t block, double density,
                                       uint64_t* kept, std::vector<uint32_t>* index, std::vector<float>* value);

// Checks a payload of exactly block_sign_bytes(rows, cols, block, kept)
// bytes: every scale finite and >= 0, no bit set past the last block or the
// last sign, and the kept blocks holding exactly `kept` entries. Reads
// nothing outside `in`; block >= 1.
Status check_block_sign(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, uint64_t kept);

// Calls out(j, index, value) for the j-th kept entry of a checked payload,
// indices ascending: a dense decoder writes straight into its tensor, a
// sparse one into its lists.
template <typename Out>
void for_each_block_sign(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, Out out) {
  const uint64_t per_row = blocks_per_row(cols, block), blocks = rows * per_row;
  const uint8_t* bitmap = in + 4 * rows;
  const uint8_t* signs = bitmap + (blocks + 7) / 8;
  uint64_t j = 0;
  for (uint64_t at = 0; at < blocks; ++at) {
    if (!((bitmap[at / 8] >> (at % 8)) & 1)) continue;
    const uint64_t r = at / per_row, b = at % per_row;
    const uint64_t first = r * cols + b * block, len = std::min(cols, (b + 1) * block) - b * block;
    float plus;
    std::memcpy(&plus, in + 4 * r, sizeof plus);
    const float minus = -plus;
    uint64_t c = 0;
    for (; c < len && j % 8 != 0; ++c, ++j) out(j, first + c, (signs[j / 8] >> (j % 8)) & 1 ? minus : plus);
    for (; c + 8 <= len; c += 8, j += 8) {  // a whole sign byte at a time
      const uint8_t byte = signs[j / 8];
      for (uint64_t q = 0; q < 8; ++q) out(j + q, first + c + q, (byte >> q) & 1 ? minus : plus);
    }
    for (; c < len; ++c, ++j) out(j, first + c, (signs[j / 8] >> (j % 8)) & 1 ? minus : plus);
  }
}

}  // namespace xd::detail
