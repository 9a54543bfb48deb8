// xdmoe codec format, version 1: the one place the layout of an encoded
// tensor is defined.
//
// An encoded tensor is one metadata record and one payload frame.
//
// Metadata: one msgpack map (msgpack-cxx), carried in the wire format's
// metadata frame (transport/wire_format.h) with kFlagCompressed set:
//   "v"      u8   kCodecFormatVersion
//   "rows"   u64  rows of the tensor (1 for a flat tensor)
//   "cols"   u64  columns; rows * cols elements, row-major
//   "stages" array of stage maps, in the order they were applied:
//     {"kind": CodecKind, "bytes": u64 size of this stage's output, params...}
//   The first stage turns floats into bytes (a value codec); later stages
//   turn bytes into bytes (zstd). The last stage's output is the payload.
//
// Payload layouts of the value codecs (little-endian; n = rows * cols):
//   raw       n x f32
//   bf16      n x u16, the upper half of each f32 (round to nearest even)
//   fp16      n x IEEE binary16 (round to nearest even)
//   int8_row  optional param "block" = B in 1..kMaxCodecBlock: each row is
//             cut into ceil(cols / B) scale blocks of B entries (the last
//             shorter when B does not divide cols); without it a row is one
//             block. rows x blocks-per-row f32 scales (row-major), then
//             n x i8; x = q * scale of its block, scale = max |x| of the
//             block / 127 (0 for an all-zero block)
//   topk      param "kept" = k entries; k LEB128 varints, the gaps between
//             ascending indices (the first is the index itself), then k x
//             bf16 values in index order; every other entry decodes to 0.
//             The k kept are the k largest magnitudes; among equal
//             magnitudes at the threshold, the lower indices.
//   topk_sign the k largest nonzero magnitudes with 1-bit values (a zero has
//             no sign; k may be below the density's count): k LEB128 varint gaps as
//             in topk, then rows x f32 scale, then ceil(k / 8) bytes of sign
//             bits (bit j % 8 of byte j / 8 set: entry j is negative; the
//             unused high bits of the last byte are 0). Entry j decodes to
//             +-scale of its row; a row's scale is the mean |x| of its kept
//             entries (0 when it keeps none), the value that minimises the
//             squared error for those signs.
//   block_sign params "kept" = k entries, "block" = B in 1..kMaxCodecBlock.
//             Each row is cut
//             into ceil(cols / B) blocks of B entries (a row's last block is
//             shorter when B does not divide cols); a row keeps the
//             ceil(density x its blocks) blocks (at least one) of largest
//             sum of squares (ties: the lower block), and k is the entries
//             in all kept blocks (that rule is the encoder's: a decoder
//             takes any bitmap whose kept blocks hold k entries). rows x f32 scale, then a bitmap of the
//             rows x ceil(cols / B) blocks in row-major order (bit j % 8 of
//             byte j / 8 set: block j is kept), then ceil(k / 8) bytes of sign
//             bits of the kept entries in index order (as in topk_sign); the
//             unused high bits of both bit strings are 0. An entry of a kept
//             block decodes to +-scale of its row by its float sign bit (+0
//             to +scale, -0 to -scale), scale = the mean |x| of the row's
//             kept entries, summed in block order; every other entry to 0.
//             The block bitmap costs 1/B bit an entry, not an index each.
//   int4_row  optional param "block", scale blocks as in int8_row: rows x
//             blocks-per-row f32 scales, then per row ceil(cols / 2) bytes of
//             nibbles (entry c: the low nibble of byte c / 2 when c is even,
//             the high one when odd; an odd row's unused last nibble is 0);
//             a nibble holds q + 8, q in [-7, 7]; x = q * scale of its block,
//             scale = max |x| of the block / 7 (0 for an all-zero block)
// Byte codecs:
//   zstd      param "level"; one zstd frame whose content size is the
//             previous stage's "bytes"
//
// Decoding trusts nothing: a record of another version, an unknown kind, a
// size that disagrees with the shape or the next stage, an index out of range
// or out of order, a truncated or trailing varint, a zstd frame that
// decompresses to another size -- each is an error naming it, never a crash
// or a read outside the buffers.
//
// Enum values are explicit and only ever appended to.
#pragma once

#include <cstdint>

namespace xd {

inline constexpr uint8_t kCodecFormatVersion = 1;

enum class CodecKind : uint8_t {
  kRaw = 0,
  kBf16 = 1,
  kFp16 = 2,
  kInt8Row = 3,
  kTopK = 4,
  kZstd = 5,
  kTopKSign = 6,
  kBlockSign = 7,
  kInt4Row = 8,
};

// block_sign's block and int8_row's and int4_row's scale block are at most
// this many entries.
inline constexpr uint64_t kMaxCodecBlock = 1 << 16;

// Decoding refuses tensors above this many elements (2^34, 64 GiB of f32).
inline constexpr uint64_t kMaxCodecElements = uint64_t(1) << 34;

// The bytes of topk_sign's (and block_sign's) sign bits for `kept` entries.
inline constexpr uint64_t codec_sign_bytes(uint64_t kept) { return (kept + 7) / 8; }

}  // namespace xd
