#include "compression/detail/every_sign.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace xd::detail {

namespace {

constexpr uint32_t kSignBit = 0x80000000u;

uint32_t bits_of(const float* x) {
  uint32_t u;
  std::memcpy(&u, x, sizeof u);
  return u;
}

// out[k] = x[k]'s sign on `scale` (>= 0) for k < count.
void signs_on_scale(const float* x, uint64_t count, float scale, float* out) {
  uint64_t k = 0;
#if defined(__SSE2__)
  const __m128 sign = _mm_castsi128_ps(_mm_set1_epi32(static_cast<int>(kSignBit)));
  const __m128 s = _mm_set1_ps(scale);
  for (; k + 4 <= count; k += 4) _mm_storeu_ps(out + k, _mm_or_ps(s, _mm_and_ps(sign, _mm_loadu_ps(x + k))));
#endif
  const uint32_t scale_bits = std::bit_cast<uint32_t>(scale);
  for (; k < count; ++k) out[k] = std::bit_cast<float>(scale_bits | (bits_of(x + k) & kSignBit));
}

// The sign bits of x[0, n), low bit first, the last byte zero-padded.
void pack_signs(const float* x, uint64_t n, uint8_t* out) {
  uint64_t i = 0;
#if defined(__SSE2__)
  for (; i + 8 <= n; i += 8)
    out[i / 8] = static_cast<uint8_t>(_mm_movemask_ps(_mm_loadu_ps(x + i)) |
                                      _mm_movemask_ps(_mm_loadu_ps(x + i + 4)) << 4);
#endif
  for (; i < n; i += 8) {
    uint8_t b = 0;
    for (uint64_t k = i; k < i + 8 && k < n; ++k) b |= static_cast<uint8_t>(bits_of(x + k) >> 31) << (k - i);
    out[i / 8] = b;
  }
}

#if defined(__SSE2__)
// kNibbleSigns[m] holds, in lane k, the sign bit when bit k of m is set.
struct NibbleSigns {
  alignas(16) uint32_t lanes[16][4];
  constexpr NibbleSigns() : lanes() {
    for (int m = 0; m < 16; ++m)
      for (int k = 0; k < 4; ++k) lanes[m][k] = (m >> k) & 1 ? kSignBit : 0u;
  }
};
constexpr NibbleSigns kNibbleSigns;
#endif

}  // namespace

bool has_zero(const float* x, uint64_t n) {
  uint64_t i = 0;
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  __m128 any = zero;
  for (; i + 4 <= n; i += 4) any = _mm_or_ps(any, _mm_cmpeq_ps(_mm_loadu_ps(x + i), zero));
  if (_mm_movemask_ps(any)) return true;
#endif
  bool found = false;
  for (; i < n; ++i) found |= x[i] == 0.0f;
  return found;
}

void encode_every_sign(const float* x, uint64_t rows, uint64_t cols, uint8_t* out, float* decoded) {
  const uint64_t n = rows * cols;
  out[0] = 0;  // the first index, then gaps of 1
  std::memset(out + 1, 1, n - 1);
  uint8_t* scales = out + n;
  // Each row sums in column order, as the general path sums its kept
  // entries; four rows at a time, so four chains of additions overlap.
  constexpr uint64_t kRowsAtOnce = 4;
  for (uint64_t r0 = 0; r0 < rows; r0 += kRowsAtOnce) {
    const uint64_t count = std::min(kRowsAtOnce, rows - r0);
    double sum[kRowsAtOnce] = {0, 0, 0, 0};
    if (count == kRowsAtOnce) {
      const float* row = x + r0 * cols;
      for (uint64_t c = 0; c < cols; ++c) {
        sum[0] += std::abs(row[c]);
        sum[1] += std::abs(row[cols + c]);
        sum[2] += std::abs(row[2 * cols + c]);
        sum[3] += std::abs(row[3 * cols + c]);
      }
    } else {
      for (uint64_t k = 0; k < count; ++k)
        for (uint64_t c = 0; c < cols; ++c) sum[k] += std::abs(x[(r0 + k) * cols + c]);
    }
    for (uint64_t k = 0; k < count; ++k) {
      const uint64_t r = r0 + k;
      const float scale = static_cast<float>(sum[k] / static_cast<double>(cols));
      std::memcpy(scales + 4 * r, &scale, sizeof scale);
      if (decoded) signs_on_scale(x + r * cols, cols, scale, decoded + r * cols);
    }
  }
  pack_signs(x, n, scales + 4 * rows);
}

bool is_every_sign(const uint8_t* in, uint64_t bytes, uint64_t kept, uint64_t rows, uint64_t cols) {
  const uint64_t n = rows * cols;
  if (n == 0 || kept != n || bytes != every_sign_bytes(rows, cols) || in[0] != 0) return false;
  uint64_t i = 1;
#if defined(__SSE2__)
  const __m128i ones = _mm_set1_epi8(1);
  __m128i differ = _mm_setzero_si128();
  for (; i + 16 <= n; i += 16)
    differ = _mm_or_si128(differ, _mm_xor_si128(ones, _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  if (_mm_movemask_epi8(_mm_cmpeq_epi8(differ, _mm_setzero_si128())) != 0xffff) return false;
#endif
  uint8_t differ_tail = 0;
  for (; i < n; ++i) differ_tail |= in[i] ^ 1;
  return differ_tail == 0;
}

void decode_every_sign(const uint8_t* in, uint64_t rows, uint64_t cols, float* out) {
  const uint64_t n = rows * cols;
  const uint8_t* scales = in + n;
  const uint8_t* signs = scales + 4 * rows;
  for (uint64_t r = 0; r < rows; ++r) {
    uint32_t scale_bits;
    std::memcpy(&scale_bits, scales + 4 * r, sizeof scale_bits);
    uint64_t j = r * cols;
    const uint64_t end = j + cols;
    auto one = [&](uint64_t at) {
      out[at] = std::bit_cast<float>(scale_bits | static_cast<uint32_t>((signs[at / 8] >> (at % 8)) & 1) << 31);
    };
#if defined(__SSE2__)
    for (; j % 4 != 0 && j < end; ++j) one(j);  // to a nibble of the sign bytes
    const __m128 scale = _mm_castsi128_ps(_mm_set1_epi32(static_cast<int>(scale_bits)));
    for (; j + 4 <= end; j += 4) {
      const unsigned nibble = (signs[j / 8] >> (j % 8)) & 15u;
      const __m128 sign = _mm_load_ps(reinterpret_cast<const float*>(kNibbleSigns.lanes[nibble]));
      _mm_storeu_ps(out + j, _mm_or_ps(scale, sign));
    }
#endif
    for (; j < end; ++j) one(j);
  }
}

}  // namespace xd::detail
