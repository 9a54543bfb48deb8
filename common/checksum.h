// CRC-32C (Castagnoli), the checksum distributed checkpoints record for every
// shard (model/distributed_checkpoint.h). Software, slice-by-8: about 1-2 GB/s
// per core, enough to verify a shard as it is read. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace xd {

// Continues a CRC-32C over `size` more bytes: crc32c(b, crc32c(a)) ==
// crc32c(a + b). Start with 0.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

// "crc32c:1a2b3c4d", the spelling manifests use.
std::string crc32c_text(uint32_t crc);

}  // namespace xd
