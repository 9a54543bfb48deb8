#include "compression/detail/block_sign.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "compression/detail/top_k.h"

namespace xd::detail {

namespace {

bool bit(const uint8_t* bits, uint64_t j) { return (bits[j / 8] >> (j % 8)) & 1; }

// Bits at or past `used` in the last byte of a bit string must be 0.
bool tail_clear(const uint8_t* bits, uint64_t used) { return used % 8 == 0 || (bits[used / 8] >> (used % 8)) == 0; }

}  // namespace

std::vector<uint8_t> encode_block_sign(const float* x, uint64_t rows, uint64_t cols, uint64_t block, double density,
                                       uint64_t* kept, std::vector<uint32_t>* index, std::vector<float>* value) {
  const uint64_t per_row = blocks_per_row(cols, block);
  const uint64_t keep = kept_count(density, per_row);
  std::vector<uint8_t> bitmap((rows * per_row + 7) / 8, 0);
  std::vector<float> scale(rows, 0.0f);
  std::vector<std::pair<double, uint64_t>> energy(per_row);  // (sum of squares, block)
  uint64_t entries = 0;
  for (uint64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    for (uint64_t b = 0; b < per_row; ++b) {
      const float* at = row + b * block;
      const uint64_t len = std::min(cols, (b + 1) * block) - b * block;
      double e = 0;
      for (uint64_t c = 0; c < len; ++c) e += double(at[c]) * at[c];
      energy[b] = {e, b};
    }
    // Largest energy first, ties to the lower block: the same choice everywhere.
    auto before = [](const std::pair<double, uint64_t>& a, const std::pair<double, uint64_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    if (keep == 0) continue;  // a row of no columns
    std::nth_element(energy.begin(), energy.begin() + (keep - 1), energy.end(), before);
    for (uint64_t j = 0; j < keep; ++j) {
      const uint64_t at = r * per_row + energy[j].second;
      bitmap[at / 8] |= static_cast<uint8_t>(1u << (at % 8));
    }
    // Summed in block order, not in nth_element's: the same bits from any
    // standard library.
    double magnitude = 0;
    uint64_t count = 0;
    for (uint64_t b = 0; b < per_row; ++b) {
      if (!bit(bitmap.data(), r * per_row + b)) continue;
      const uint64_t len = std::min(cols, (b + 1) * block) - b * block;
      for (uint64_t c = 0; c < len; ++c) magnitude += std::abs(row[b * block + c]);
      count += len;
    }
    // The mean |x| of the kept entries minimises the squared error for their signs.
    scale[r] = count ? static_cast<float>(magnitude / static_cast<double>(count)) : 0.0f;
    entries += count;
  }
  *kept = entries;
  std::vector<uint8_t> out(block_sign_bytes(rows, cols, block, entries), 0);
  if (rows) std::memcpy(out.data(), scale.data(), 4 * rows);
  if (!bitmap.empty()) std::memcpy(out.data() + 4 * rows, bitmap.data(), bitmap.size());
  uint8_t* signs = out.data() + 4 * rows + bitmap.size();
  const size_t before = index ? index->size() : 0, before_v = value ? value->size() : 0;
  if (index) index->resize(before + entries);
  if (value) value->resize(before_v + entries);
  uint32_t* ix = index ? index->data() + before : nullptr;
  float* vx = value ? value->data() + before_v : nullptr;
  uint64_t j = 0;
  for (uint64_t r = 0; r < rows; ++r)
    for (uint64_t b = 0; b < per_row; ++b) {
      if (!bit(bitmap.data(), r * per_row + b)) continue;
      const uint64_t first = r * cols + b * block, len = std::min(cols, (b + 1) * block) - b * block;
      const float plus = scale[r], minus = -scale[r];
      for (uint64_t c = 0; c < len; ++c, ++j) {
        const bool negative = std::signbit(x[first + c]);
        signs[j / 8] |= static_cast<uint8_t>(negative << (j % 8));
        if (ix) ix[j] = static_cast<uint32_t>(first + c);
        if (vx) vx[j] = negative ? minus : plus;
      }
    }
  return out;
}

Status check_block_sign(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, uint64_t kept) {
  const uint64_t per_row = blocks_per_row(cols, block), blocks = rows * per_row;
  const uint8_t* bitmap = in + 4 * rows;
  const uint8_t* signs = bitmap + (blocks + 7) / 8;
  for (uint64_t r = 0; r < rows; ++r) {
    float scale;
    std::memcpy(&scale, in + 4 * r, sizeof scale);
    if (!std::isfinite(scale) || scale < 0)
      return Status::corruption("block_sign: bad scale in row " + std::to_string(r));
  }
  if (blocks && !tail_clear(bitmap, blocks))
    return Status::corruption("block_sign: block bits set beyond the last block");
  uint64_t entries = 0;
  for (uint64_t at = 0; at < blocks; ++at)
    if (bit(bitmap, at)) entries += std::min(cols, (at % per_row + 1) * block) - (at % per_row) * block;
  if (entries != kept)
    return Status::corruption("block_sign: the kept blocks hold " + std::to_string(entries) +
                              " entries, the record says " + std::to_string(kept));
  if (kept && !tail_clear(signs, kept)) return Status::corruption("block_sign: sign bits set beyond the kept entries");
  return Status::ok();
}

}  // namespace xd::detail
