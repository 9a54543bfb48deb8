#include "common/checksum.h"

#include <array>
#include <cstdio>
#include <cstring>

namespace xd {

namespace {

// table[k][b]: the CRC of byte b followed by k zero bytes (slice-by-8).
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    constexpr uint32_t kPolynomial = 0x82F63B78u;  // Castagnoli, reflected
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPolynomial & (0u - (c & 1u)));
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b)
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
};

const Tables& tables() {
  static const Tables tables;
  return tables;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto& t = tables().t;
  const unsigned char* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (size >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;  // little-endian hosts only (x86-64, aarch64)
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

std::string crc32c_text(uint32_t crc) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "crc32c:%08x", crc);
  return buf;
}

}  // namespace xd
