// topk_sign keeping every entry of a tensor that holds no zero ("every
// sign", topk_sign:1). Its index list is then 0 followed by n - 1 gaps of 1,
// one byte each, and every row keeps all its columns, so these functions
// write and read exactly the bytes of the general topk_sign path (codec.cc
// encodes, codec_decode.cc decodes) without building or walking a list of
// indices. It is the 1-bit codec's common case: a residual or a gradient
// rarely holds an exact zero.
//
// Layout (compression/codec_format.h, topk_sign): n index bytes, then one
// f32 scale per row (the mean |x| of the row, summed in column order in
// double), then one sign bit per entry, low bit first, zero-padded.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

#include "compression/codec_format.h"

namespace xd::detail {

// The payload's size for rows x cols entries, all kept.
inline uint64_t every_sign_bytes(uint64_t rows, uint64_t cols) {
  const uint64_t n = rows * cols;
  return n + 4 * rows + codec_sign_bytes(n);
}

// 0, 1, ..., n - 1: the indices of a message that keeps every entry.
inline void every_index(uint64_t n, std::vector<uint32_t>* index) {
  index->resize(n);
  std::iota(index->begin(), index->end(), 0u);
}

// True when x[0, n) holds a zero (+0 or -0). One branch-free pass.
bool has_zero(const float* x, uint64_t n);

// Writes the payload of x (finite, no zero, rows * cols >= 1) to
// out[0, every_sign_bytes). With `decoded` (rows * cols floats), also each
// entry as the decoder gives it: its sign on its row's scale.
void encode_every_sign(const float* x, uint64_t rows, uint64_t cols, uint8_t* out, float* decoded);

// True when a topk_sign payload of `bytes` bytes keeping `kept` entries of
// rows x cols is this form: every entry kept, the index list 0, 1, 1, ...
bool is_every_sign(const uint8_t* in, uint64_t bytes, uint64_t kept, uint64_t rows, uint64_t cols);

// Decodes such a payload into out[0, rows * cols). The caller has checked
// what the general decoder checks of the values: finite scales >= 0 and no
// sign bit past the last entry.
void decode_every_sign(const uint8_t* in, uint64_t rows, uint64_t cols, float* out);

}  // namespace xd::detail
