#include "compression/detail/int_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "compression/detail/number_formats.h"

namespace xd::detail {

namespace {

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

Status bad_scale(const char* codec, uint64_t row, float scale) {
  if (std::isfinite(scale) && scale >= 0) return Status::ok();
  return Status::corruption(std::string(codec) + ": bad scale in row " + std::to_string(row));
}

}  // namespace

void encode_int8_rows(const float* x, uint64_t rows, uint64_t cols, uint64_t block, uint8_t* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out + 4 * rows * scale_blocks(cols, block));
  for_each_scale_block(rows, cols, block, [&](uint64_t r, uint64_t first, uint64_t end, uint64_t slot) {
    const float* row = x + r * cols;
    const RowScale rs = symmetric_row_scale(row + first, end - first, 127.0f);
    std::memcpy(out + 4 * slot, &rs.scale, sizeof rs.scale);
    for (uint64_t c = first; c < end; ++c) q[r * cols + c] = static_cast<int8_t>(quantize(row[c] * rs.inverse, 127.0f));
  });
}

void encode_int4_rows(const float* x, uint64_t rows, uint64_t cols, uint64_t block, uint8_t* out) {
  const uint64_t row_bytes = (cols + 1) / 2;
  uint8_t* q = out + 4 * rows * scale_blocks(cols, block);
  if (rows * row_bytes != 0) std::memset(q, 0, rows * row_bytes);  // q is null for an empty payload
  for_each_scale_block(rows, cols, block, [&](uint64_t r, uint64_t first, uint64_t end, uint64_t slot) {
    const float* row = x + r * cols;
    const RowScale rs = symmetric_row_scale(row + first, end - first, 7.0f);
    std::memcpy(out + 4 * slot, &rs.scale, sizeof rs.scale);
    uint8_t* b = q + r * row_bytes;
    for (uint64_t c = first; c < end; ++c)
      b[c / 2] |= static_cast<uint8_t>((quantize(row[c] * rs.inverse, 7.0f) + 8) << (4 * (c & 1)));
  });
}

Status decode_int8_rows(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, float* out) {
  const int8_t* q = reinterpret_cast<const int8_t*>(in + 4 * rows * scale_blocks(cols, block));
  Status st;
  for_each_scale_block(rows, cols, block, [&](uint64_t r, uint64_t first, uint64_t end, uint64_t slot) {
    if (!st.is_ok()) return;
    float scale;
    std::memcpy(&scale, in + 4 * slot, sizeof scale);
    st = bad_scale("int8_row", r, scale);
    if (!st.is_ok()) return;
    for (uint64_t c = first; c < end; ++c) out[r * cols + c] = q[r * cols + c] * scale;
  });
  return st;
}

Status decode_int4_rows(const uint8_t* in, uint64_t rows, uint64_t cols, uint64_t block, float* out) {
  const uint64_t row_bytes = (cols + 1) / 2;
  const uint8_t* q = in + 4 * rows * scale_blocks(cols, block);
  Status st;
  for_each_scale_block(rows, cols, block, [&](uint64_t r, uint64_t first, uint64_t end, uint64_t slot) {
    if (!st.is_ok()) return;
    float scale;
    std::memcpy(&scale, in + 4 * slot, sizeof scale);
    st = bad_scale("int4_row", r, scale);
    if (!st.is_ok()) return;
    const uint8_t* b = q + r * row_bytes;
    float* o = out + r * cols;
    bool zero_nibble = false;
    for (uint64_t c = first; c < end; ++c) {
      const int v = (b[c / 2] >> (4 * (c & 1))) & 15;
      zero_nibble |= v == 0;
      o[c] = static_cast<float>(v - 8) * scale;
    }
    if (zero_nibble) st = Status::corruption("int4_row: a value nibble of 0 in row " + std::to_string(r));
    else if (end == cols && (cols & 1) && (b[row_bytes - 1] >> 4) != 0)
      st = Status::corruption("int4_row: padding bits set in row " + std::to_string(r));
  });
  return st;
}

}  // namespace xd::detail
