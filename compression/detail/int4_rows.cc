#include "compression/detail/int4_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace xd::detail {

namespace {

// Round to nearest, ties to even, without a library call (as int8_row):
// adding and taking away 1.5 * 2^23 rounds a value of [-7, 7] to an integer.
inline uint8_t nibble(float v) {
  constexpr float kRounder = 12582912.0f;
  const float rounded = (std::clamp(v, -7.0f, 7.0f) + kRounder) - kRounder;
  // A row whose scale is so small that its inverse overflows gives 0 * inf,
  // NaN, for its zeros: they stay 0 (nibble 8).
  return static_cast<uint8_t>(rounded == rounded ? static_cast<int>(rounded) + 8 : 8);
}

}  // namespace

void encode_int4_rows(const float* x, uint64_t rows, uint64_t cols, uint8_t* out) {
  const uint64_t row_bytes = (cols + 1) / 2;
  uint8_t* q = out + 4 * rows;
  for (uint64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    float amax = 0;
    for (uint64_t c = 0; c < cols; ++c) amax = std::max(amax, std::abs(row[c]));
    const float scale = amax / 7.0f;
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    std::memcpy(out + 4 * r, &scale, sizeof scale);
    uint8_t* b = q + r * row_bytes;
    uint64_t c = 0;
    for (; c + 1 < cols; c += 2)
      b[c / 2] = static_cast<uint8_t>(nibble(row[c] * inv) | nibble(row[c + 1] * inv) << 4);
    if (c < cols) b[c / 2] = nibble(row[c] * inv);
  }
}

Status decode_int4_rows(const uint8_t* in, uint64_t rows, uint64_t cols, float* out) {
  const uint64_t row_bytes = (cols + 1) / 2;
  const uint8_t* q = in + 4 * rows;
  for (uint64_t r = 0; r < rows; ++r) {
    float scale;
    std::memcpy(&scale, in + 4 * r, sizeof scale);
    if (!std::isfinite(scale) || scale < 0) return Status::corruption("int4_row: bad scale in row " + std::to_string(r));
    const uint8_t* b = q + r * row_bytes;
    float* o = out + r * cols;
    bool zero_nibble = false;
    for (uint64_t c = 0; c < cols; ++c) {
      const int v = (b[c / 2] >> (4 * (c & 1))) & 15;
      zero_nibble |= v == 0;
      o[c] = static_cast<float>(v - 8) * scale;
    }
    if (zero_nibble) return Status::corruption("int4_row: a value nibble of 0 in row " + std::to_string(r));
    if ((cols & 1) && (b[row_bytes - 1] >> 4) != 0)
      return Status::corruption("int4_row: padding bits set in row " + std::to_string(r));
  }
  return Status::ok();
}

}  // namespace xd::detail
