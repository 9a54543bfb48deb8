#include "compression/detail/int4_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "compression/detail/number_formats.h"

namespace xd::detail {

namespace {

// A row whose scale is so small that its inverse overflows gives 0 * inf,
// NaN, for its zeros: they stay 0 (nibble 8).
inline uint8_t nibble(float v) {
  const float rounded = round_ties_to_even(std::clamp(v, -7.0f, 7.0f));
  return static_cast<uint8_t>(rounded == rounded ? static_cast<int>(rounded) + 8 : 8);
}

}  // namespace

void encode_int4_rows(const float* x, uint64_t rows, uint64_t cols, uint8_t* out) {
  const uint64_t row_bytes = (cols + 1) / 2;
  uint8_t* q = out + 4 * rows;
  for (uint64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    const RowScale rs = symmetric_row_scale(row, cols, 7.0f);
    std::memcpy(out + 4 * r, &rs.scale, sizeof rs.scale);
    uint8_t* b = q + r * row_bytes;
    uint64_t c = 0;
    for (; c + 1 < cols; c += 2)
      b[c / 2] = static_cast<uint8_t>(nibble(row[c] * rs.inverse) | nibble(row[c + 1] * rs.inverse) << 4);
    if (c < cols) b[c / 2] = nibble(row[c] * rs.inverse);
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
