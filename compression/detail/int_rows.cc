#include "compression/detail/int_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace xd::detail {

namespace {

// Round to nearest, ties to even, as lrint does in the default rounding
// mode, without its library call: past 2^23 a float's step is 1, so adding
// and taking away 1.5 * 2^23 rounds a value of magnitude below 2^22 to an
// integer. NaN stays NaN.
inline float round_ties_to_even(float v) {
  constexpr float kRounder = 12582912.0f;
  return (v + kRounder) - kRounder;
}

// q of v = x / scale in [-levels, levels]. A block whose scale is so small
// that its inverse overflows gives 0 * inf, NaN, for its zeros: they stay 0.
inline int quantize(float v, float levels) {
  const float rounded = round_ties_to_even(std::clamp(v, -levels, levels));
  return rounded == rounded ? static_cast<int>(rounded) : 0;
}

// Calls block_fn(row, first, end, scale_slot) for each scale block [first,
// end) of each row, the scale slots in layout order.
template <typename F>
void for_each_scale_block(uint64_t rows, uint64_t cols, uint64_t block, F block_fn) {
  const uint64_t per_row = scale_blocks(cols, block), len = block == 0 ? cols : block;
  if (per_row == 0) return;  // empty rows with a scale block: nothing, however many rows
  for (uint64_t r = 0; r < rows; ++r)
    for (uint64_t b = 0; b < per_row; ++b) {
      const uint64_t first = b * len;
      block_fn(r, first, std::min(cols, first + len), r * per_row + b);
    }
}

// Writes each block's scale (its largest magnitude over `levels`, 0 for an
// all-zero block) to its slot in `scales`, then calls
// values_fn(row, first, end, inverse) with the scale's inverse (0 for 0).
template <typename F>
void encode_blocks(const float* x, uint64_t rows, uint64_t cols, uint64_t block, float levels, uint8_t* scales,
                   F values_fn) {
  for_each_scale_block(rows, cols, block, [&](uint64_t r, uint64_t first, uint64_t end, uint64_t slot) {
    float amax = 0;
    for (uint64_t c = first; c < end; ++c) amax = std::max(amax, std::abs(x[r * cols + c]));
    const float scale = amax / levels;
    std::memcpy(scales + 4 * slot, &scale, sizeof scale);
    values_fn(r, first, end, scale > 0 ? 1.0f / scale : 0.0f);
  });
}

// Reads each block's scale from `scales`, refuses one that is not finite or
// negative, and calls values_fn(row, first, end, scale) -> Status; stops at
// the first error.
template <typename F>
Status decode_blocks(const uint8_t* scales, uint64_t rows, uint64_t cols, uint64_t block, const char* codec,
                     F values_fn) {
  Status st;
  for_each_scale_block(rows, cols, block, [&](uint64_t r, uint64_t first, uint64_t end, uint64_t slot) {
    if (!st.is_ok()) return;
    float scale;
    std::memcpy(&scale, scales + 4 * slot, sizeof scale);
    if (!std::isfinite(scale) || scale < 0)
      st = Status::corruption(std::string(codec) + ": bad scale in row " + std::to_string(r));
    else
      st = values_fn(r, first, end, scale);
  });
  return st;
}

}  // namespace

void encode_int8_rows(const float* x, uint64_t rows, uint64_t cols, uint64_t block, uint8_t* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out + 4 * rows * scale_blocks(cols, block));
  encode_blocks(x, rows, cols, block, 127.0f, out, [&](uint64_t r, uint64_t first, uint64_t end, float inverse) {
    for (uint64_t c = first; c < end; ++c)
      q[r * cols + c] = static_cast<int8_t>(quantize(x[r * cols + c] * inverse, 127.0f));
  });
}

void encode_int4_rows(const float* x, uint64_t rows, uint64_t cols, uint64_t block, uint8_t* out) {
  const uint64_t row_bytes = (cols + 1) / 2;
  uint8_t* q = out + 4 * rows * scale_blocks(cols, block);
  encode_blocks(x, rows, cols, block, 7.0f, out, [&](uint64_t r, uint64_t first, uint64_t end, float inverse) {
    const float* row = x + r * cols;
    uint8_t* b = q + r * row_bytes;
    auto nibble = [&](uint64_t c) { return static_cast<uint8_t>(quantize(row[c] * inverse, 7.0f) + 8); };
    // Blocks run in order, so a byte's low nibble is written (=) before its
    // high one: a block that starts mid-byte adds its first entry to the
    // previous block's last byte, and a row's padding nibble stays 0.
    uint64_t c = first;
    if (c & 1) b[c++ / 2] |= static_cast<uint8_t>(nibble(first) << 4);
    for (; c + 1 < end; c += 2) b[c / 2] = static_cast<uint8_t>(nibble(c) | nibble(c + 1) << 4);
    if (c < end) b[c / 2] = nibble(c);
  });
}

Status decode_int8_rows(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, float* out) {
  const int8_t* q = reinterpret_cast<const int8_t*>(in + 4 * rows * scale_blocks(cols, block));
  return decode_blocks(in, rows, cols, block, "int8_row", [&](uint64_t r, uint64_t first, uint64_t end, float scale) {
    for (uint64_t c = first; c < end; ++c) out[r * cols + c] = q[r * cols + c] * scale;
    return Status::ok();
  });
}

Status decode_int4_rows(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, float* out) {
  const uint64_t row_bytes = (cols + 1) / 2;
  const uint8_t* q = in + 4 * rows * scale_blocks(cols, block);
  return decode_blocks(in, rows, cols, block, "int4_row", [&](uint64_t r, uint64_t first, uint64_t end, float scale) {
    const uint8_t* b = q + r * row_bytes;
    bool zero_nibble = false;
    for (uint64_t c = first; c < end; ++c) {
      const int v = (b[c / 2] >> (4 * (c & 1))) & 15;
      zero_nibble |= v == 0;
      out[r * cols + c] = static_cast<float>(v - 8) * scale;
    }
    if (zero_nibble) return Status::corruption("int4_row: a value nibble of 0 in row " + std::to_string(r));
    if (end == cols && (cols & 1) && (b[row_bytes - 1] >> 4) != 0)
      return Status::corruption("int4_row: padding bits set in row " + std::to_string(r));
    return Status::ok();
  });
}

}  // namespace xd::detail
