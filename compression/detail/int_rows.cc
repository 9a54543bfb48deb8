#include "compression/detail/int_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace xd::detail {

namespace {

// Round to nearest, ties to even, as lrint does in the default rounding
// mode, without its library call: past 2^23 a float's step is 1, so adding
// and taking away 1.5 * 2^23 rounds a value of magnitude below 2^22 to an
// integer. NaN stays NaN. (quantize4 below adds and takes away the same.)
constexpr float kRounder = 12582912.0f;
inline float round_ties_to_even(float v) { return (v + kRounder) - kRounder; }

// q of v = x / scale in [-levels, levels]. A block whose scale is so small
// that its inverse overflows gives 0 * inf, NaN, for its zeros: they stay 0.
inline int quantize(float v, float levels) {
  const float rounded = round_ties_to_even(std::clamp(v, -levels, levels));
  return rounded == rounded ? static_cast<int>(rounded) : 0;
}

// max(|x[i]|) over n entries, 0 for none, as a loop of std::max(m, |x|)
// gives: NaN never wins a comparison, and the order does not change a
// maximum. With SSE2, 16 at once in four independent running maxima.
inline float largest_magnitude(const float* x, uint64_t n) {
  uint64_t i = 0;
  float m = 0;
#ifdef __SSE2__
  if (n >= 16) {
    const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128 m0 = _mm_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
    // maxps(a, b) is a > b ? a : b: a NaN entry as `a` leaves the maximum.
    for (; i + 16 <= n; i += 16) {
      m0 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(x + i), abs_mask), m0);
      m1 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(x + i + 4), abs_mask), m1);
      m2 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(x + i + 8), abs_mask), m2);
      m3 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(x + i + 12), abs_mask), m3);
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
    for (float lane : lanes) m = std::max(m, lane);
  }
#endif
  for (; i < n; ++i) m = std::max(m, std::abs(x[i]));
  return m;
}

#ifdef __SSE2__
// Four entries' q as quantize(x * inverse, levels) gives them, lane by
// lane: the same clamp for every value but NaN (which comes out 0 by the
// mask), then the same rounding, exact conversion.
inline __m128i quantize4(const float* x, __m128 inverse, float levels) {
  const __m128 v = _mm_mul_ps(_mm_loadu_ps(x), inverse);
  const __m128 not_nan = _mm_cmpeq_ps(v, v);
  const __m128 clamped = _mm_min_ps(_mm_max_ps(v, _mm_set1_ps(-levels)), _mm_set1_ps(levels));
  const __m128 rounder = _mm_set1_ps(kRounder);
  const __m128 rounded = _mm_sub_ps(_mm_add_ps(clamped, rounder), rounder);
  return _mm_and_si128(_mm_cvttps_epi32(rounded), _mm_castps_si128(not_nan));
}

// 16 entries' int8 values into out[0..16).
inline void int8_values16(const float* x, float inverse, int8_t* out) {
  const __m128 inv = _mm_set1_ps(inverse);
  const __m128i low = _mm_packs_epi32(quantize4(x, inv, 127.0f), quantize4(x + 4, inv, 127.0f));
  const __m128i high = _mm_packs_epi32(quantize4(x + 8, inv, 127.0f), quantize4(x + 12, inv, 127.0f));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(low, high));
}

// 16 entries' nibbles (q + 8), two a byte (the even entry low), into out[0..8).
inline void int4_nibbles16(const float* x, float inverse, uint8_t* out) {
  const __m128 inv = _mm_set1_ps(inverse);
  const __m128i eight = _mm_set1_epi32(8);
  auto codes4 = [&](const float* at) { return _mm_add_epi32(quantize4(at, inv, 7.0f), eight); };
  const __m128i low = _mm_packs_epi32(codes4(x), codes4(x + 4));
  const __m128i high = _mm_packs_epi32(codes4(x + 8), codes4(x + 12));
  const __m128i codes = _mm_packus_epi16(low, high);  // one code (1..15) a byte, in order
  // Each 16-bit pair (even | odd << 8) to even | odd << 4 in its low byte.
  const __m128i pairs = _mm_and_si128(_mm_or_si128(codes, _mm_srli_epi16(codes, 4)), _mm_set1_epi16(0x00ff));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(pairs, pairs));
}

// The inverse: 8 bytes' 16 nibbles to (nibble - 8) * scale in out[0..16),
// as the scalar loop converts and multiplies. Returns whether a nibble was 0.
inline bool int4_values16(const uint8_t* in, float scale, float* out) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  const bool zero = _mm_movemask_epi8(_mm_cmpeq_epi8(codes, _mm_setzero_si128())) != 0;
  const __m128i none = _mm_setzero_si128(), eight = _mm_set1_epi32(8);
  const __m128i low = _mm_unpacklo_epi8(codes, none), high = _mm_unpackhi_epi8(codes, none);
  const __m128i q[4] = {_mm_unpacklo_epi16(low, none), _mm_unpackhi_epi16(low, none), _mm_unpacklo_epi16(high, none),
                        _mm_unpackhi_epi16(high, none)};
  const __m128 s = _mm_set1_ps(scale);
  for (int k = 0; k < 4; ++k) _mm_storeu_ps(out + 4 * k, _mm_mul_ps(_mm_cvtepi32_ps(_mm_sub_epi32(q[k], eight)), s));
  return zero;
}
#endif

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
    const float scale = largest_magnitude(x + r * cols + first, end - first) / levels;
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
    uint64_t c = first;
#ifdef __SSE2__
    for (; c + 16 <= end; c += 16) int8_values16(x + r * cols + c, inverse, q + r * cols + c);
#endif
    for (; c < end; ++c)
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
#ifdef __SSE2__
    for (; c + 16 <= end; c += 16) int4_nibbles16(row + c, inverse, b + c / 2);
#endif
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
    uint64_t c = first;
#ifdef __SSE2__
    if ((c & 1) == 0)
      for (; c + 16 <= end; c += 16) zero_nibble |= int4_values16(b + c / 2, scale, out + r * cols + c);
#endif
    for (; c < end; ++c) {
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
