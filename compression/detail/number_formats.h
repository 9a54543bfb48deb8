// Element conversions and integer coding used by the codecs: f32 <-> bf16
// (round to nearest even, NaN kept a NaN), f32 <-> fp16 (the compiler's
// correctly rounded _Float16), and LEB128 varints. Pure inline functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace xd::detail {

inline uint16_t float_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_float(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }

inline uint16_t float_to_fp16(float f) { return std::bit_cast<uint16_t>(static_cast<_Float16>(f)); }
inline float fp16_to_float(uint16_t h) { return static_cast<float>(std::bit_cast<_Float16>(h)); }

// Whole arrays of f32 <-> fp16, identical to the element functions above
// (IEEE round to nearest even). They use the F16C instructions where the CPU
// has them (checked once at run time), which, unlike the compiler's software
// conversion, cost no more for subnormals; else the element functions.
void floats_to_fp16(const float* in, size_t n, uint8_t* out);
void fp16_to_floats(const uint8_t* in, size_t n, float* out);

// The bytes put_varint writes for v.
inline size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Appends v as LEB128 (7 bits a byte, low first, high bit = more).
inline void put_varint(uint64_t v, uint8_t*& p) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
}

// Reads one varint from [p, end); false when it runs past `end` or past 64 bits.
inline bool get_varint(const uint8_t*& p, const uint8_t* end, uint64_t* v) {
  if (p < end && *p < 0x80) {  // one byte: most gaps of a top-k index list
    *v = *p++;
    return true;
  }
  uint64_t out = 0;
  for (int shift = 0; shift < 64 && p < end; shift += 7) {
    const uint8_t b = *p++;
    out |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *v = out;
      return true;
    }
  }
  return false;
}

}  // namespace xd::detail
