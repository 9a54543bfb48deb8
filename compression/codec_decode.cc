// Decoding: codec records checked, byte stages undone, value codecs read.
// Every length, index and scale a payload claims is checked before it is
// used (codec.h, "Bad input"); the encoders are in codec.cc.
#include "compression/codec.h"

#include <zstd.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "compression/codec_format.h"
#include "compression/detail/block_sign.h"
#include "compression/detail/codec_record.h"
#include "compression/detail/every_sign.h"
#include "compression/detail/int_rows.h"
#include "compression/detail/number_formats.h"
#include "compression/detail/zstd_contexts.h"

namespace xd {

namespace {

using detail::is_int_rows;
using detail::is_sparse_kind;
using detail::is_top_k;

// The exact byte size a value codec's output must have (topk: its bound).
bool value_bytes_ok(const CodecStageRecord& s, uint64_t rows, uint64_t n) {
  switch (s.kind) {
    case CodecKind::kRaw: return s.bytes == 4 * n;
    case CodecKind::kBf16:
    case CodecKind::kFp16: return s.bytes == 2 * n;
    case CodecKind::kInt8Row:  // block <= kMaxCodecBlock: scale_blocks cannot overflow
      return s.block <= kMaxCodecBlock && s.bytes == detail::int8_row_bytes(rows, n ? n / rows : 0, s.block);
    case CodecKind::kInt4Row:
      return s.block <= kMaxCodecBlock && s.bytes == detail::int4_row_bytes(rows, n ? n / rows : 0, s.block);
    case CodecKind::kTopK: return s.kept <= n && s.bytes >= 3 * s.kept && s.bytes <= 12 * s.kept;
    case CodecKind::kTopKSign: {  // rows, kept <= 2^34: no overflow
      const uint64_t fixed = 4 * rows + codec_sign_bytes(s.kept);
      return s.kept <= n && s.bytes >= s.kept + fixed && s.bytes <= 5 * s.kept + fixed;
    }
    case CodecKind::kBlockSign:  // rows, cols, kept <= 2^34 and block >= 1: no overflow
      return s.block >= 1 && s.block <= kMaxCodecBlock && s.kept <= n &&
             s.bytes == detail::block_sign_bytes(rows, n ? n / rows : 0, s.block, s.kept);
    case CodecKind::kZstd: return false;
  }
  return false;
}

// topk_sign's values (row scales, then sign bits, at `values`): the scales
// finite and >= 0, no sign bit set past the last kept entry.
Status check_signs_and_scales(const CodecStageRecord& s, const uint8_t* values, uint64_t rows) {
  for (uint64_t r = 0; r < rows; ++r) {
    float scale;
    std::memcpy(&scale, values + 4 * r, sizeof scale);
    if (!std::isfinite(scale) || scale < 0) return Status::corruption("topk_sign: bad scale in row " + std::to_string(r));
  }
  const uint8_t* signs = values + 4 * rows;
  if (s.kept % 8 != 0 && (signs[s.kept / 8] >> (s.kept % 8)) != 0)
    return Status::corruption("topk_sign: sign bits set beyond the kept entries");
  return Status::ok();
}

// A topk_sign payload that keeps every entry of its tensor (see
// detail/every_sign.h).
bool every_sign_payload(const CodecStageRecord& s, const uint8_t* in, uint64_t rows, uint64_t cols) {
  return s.kind == CodecKind::kTopKSign && detail::is_every_sign(in, s.bytes, s.kept, rows, cols);
}

// Decodes such a payload into out[0, rows * cols) after the checks the
// general path makes of its values.
Status decode_every_sign_checked(const CodecStageRecord& s, const uint8_t* in, uint64_t rows, uint64_t cols,
                                 float* out) {
  XD_RETURN_IF_ERROR(check_signs_and_scales(s, in + rows * cols, rows));
  detail::decode_every_sign(in, rows, cols, out);
  return Status::ok();
}

// Calls fn(index, value) for each entry a top-k payload (topk or topk_sign)
// keeps, indices ascending; every index is checked against n and every scale
// for being finite and >= 0 before fn sees them.
template <typename Fn>
Status for_each_kept(const CodecStageRecord& s, const uint8_t* in, uint64_t rows, uint64_t cols, Fn fn) {
  const uint64_t n = rows * cols;
  const char* name = detail::codec_kind_name(s.kind);
  const bool sign = s.kind == CodecKind::kTopKSign;
  // topk: the bf16 values; topk_sign: the row scales, then the sign bits.
  const uint8_t* values = in + s.bytes - (sign ? 4 * rows + codec_sign_bytes(s.kept) : 2 * s.kept);
  // Only topk_sign has signs; a topk payload may be empty (no arithmetic on null).
  const uint8_t* signs = sign ? values + 4 * rows : nullptr;
  if (sign) XD_RETURN_IF_ERROR(check_signs_and_scales(s, values, rows));
  const uint8_t* p = in;
  uint64_t index = 0;
  // The row of `index` and its scale (topk_sign), by a cursor: the indices
  // ascend, so no division per entry.
  uint64_t row = 0, row_end = cols;
  uint32_t scale_bits = 0;  // the row's scale, >= 0 (checked): its sign bit alone makes it -scale
  if (sign && rows > 0) std::memcpy(&scale_bits, values, sizeof scale_bits);
  for (uint64_t j = 0; j < s.kept; ++j) {
    uint64_t gap = 0;
    if (!detail::get_varint(p, values, &gap)) return Status::corruption(std::string(name) + ": truncated index list");
    if (j > 0 && gap == 0) return Status::corruption(std::string(name) + ": repeated index");
    const uint64_t next = j == 0 ? gap : index + gap;  // index < n and gap checked: no overflow
    if (gap >= n || next >= n)
      return Status::corruption(std::string(name) + ": index beyond the tensor's " + std::to_string(n) + " elements");
    index = next;
    if (sign) {
      if (index >= row_end) {  // index < n: the row stays below rows
        do {
          ++row;
          row_end += cols;
        } while (index >= row_end);
        std::memcpy(&scale_bits, values + 4 * row, sizeof scale_bits);
      }
      const uint32_t negative = (signs[j / 8] >> (j % 8)) & 1;  // no branch: the signs are random
      fn(index, std::bit_cast<float>(scale_bits | negative << 31));
    } else {
      uint16_t h;
      std::memcpy(&h, values + 2 * j, 2);
      fn(index, detail::bf16_to_float(h));
    }
  }
  if (p != values) return Status::corruption(std::string(name) + ": bytes left between the indices and the values");
  return Status::ok();
}

Status decode_values(const CodecStageRecord& s, const uint8_t* in, uint64_t rows, uint64_t cols, float* out) {
  const uint64_t n = rows * cols;
  switch (s.kind) {
    case CodecKind::kRaw:
      if (n) std::memcpy(out, in, n * sizeof(float));  // an empty tensor may have null buffers
      return Status::ok();
    case CodecKind::kBf16:
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, in + 2 * i, 2);
        out[i] = detail::bf16_to_float(h);
      }
      return Status::ok();
    case CodecKind::kFp16:
      detail::fp16_to_floats(in, n, out);
      return Status::ok();
    case CodecKind::kInt8Row:
      return detail::decode_int8_rows(in, rows, cols, s.block, out);
    case CodecKind::kInt4Row:
      return detail::decode_int4_rows(in, rows, cols, s.block, out);
    case CodecKind::kTopK:
    case CodecKind::kTopKSign:
      if (every_sign_payload(s, in, rows, cols)) return decode_every_sign_checked(s, in, rows, cols, out);
      if (n) std::memset(out, 0, n * sizeof(float));
      return for_each_kept(s, in, rows, cols, [out](uint64_t i, float v) { out[i] = v; });
    case CodecKind::kBlockSign:
      XD_RETURN_IF_ERROR(detail::check_block_sign(in, rows, cols, s.block, s.kept));
      if (n) std::memset(out, 0, n * sizeof(float));
      detail::for_each_block_sign(in, rows, cols, s.block, [out](uint64_t, uint64_t i, float v) { out[i] = v; });
      return Status::ok();
    case CodecKind::kZstd: break;
  }
  return Status::internal("not a value codec");
}

}  // namespace

Expected<CodecRecord> parse_codec_record(const std::string& metadata) { return detail::unpack_codec_record(metadata); }

Status decode_tensor(const std::string& metadata, const uint8_t* payload, size_t payload_bytes, float* out,
                     size_t n) {
  auto rec = detail::unpack_codec_record(metadata);
  if (!rec) return rec.status();
  return decode_tensor(*rec, payload, payload_bytes, out, n);
}

namespace {

// Checks `rec` against n and the payload, then undoes the byte stages (last
// first): *values points at the value codec's bytes, in `buffer` or `payload`.
Status undo_byte_stages(const CodecRecord& rec, const uint8_t* payload, size_t payload_bytes, size_t n,
                        std::vector<uint8_t>* buffer, const uint8_t** values) {
  const uint64_t elements = rec.shape.elements();
  if (elements != n)
    return Status::invalid_argument("encoded tensor has " + std::to_string(elements) + " elements, the buffer " +
                                    std::to_string(n));
  const CodecStageRecord& value = rec.stages.front();
  if (!value_bytes_ok(value, rec.shape.rows, elements))
    return Status::corruption(std::string(detail::codec_kind_name(value.kind)) + ": " + std::to_string(value.bytes) +
                              " bytes do not fit a tensor of " + std::to_string(elements) + " elements");
  if (rec.stages.back().bytes != payload_bytes)
    return Status::corruption("payload of " + std::to_string(payload_bytes) + " bytes, the metadata says " +
                              std::to_string(rec.stages.back().bytes));
  const uint8_t* data = payload;
  for (size_t i = rec.stages.size() - 1; i >= 1; --i) {
    const uint64_t want = rec.stages[i - 1].bytes;
    const unsigned long long declared = ZSTD_getFrameContentSize(data, rec.stages[i].bytes);
    if (declared == ZSTD_CONTENTSIZE_ERROR || declared == ZSTD_CONTENTSIZE_UNKNOWN || declared != want)
      return Status::corruption("zstd: the frame does not declare the expected " + std::to_string(want) + " bytes");
    ZSTD_DCtx* context = detail::zstd_contexts().decompress;
    if (!context) return Status::internal("zstd: no decompression context (out of memory)");
    thread_local std::vector<uint8_t> next;  // swapped with the caller's thread_local buffer: both keep their room
    next.resize(want);
    const size_t got = ZSTD_decompressDCtx(context, next.data(), next.size(), data, rec.stages[i].bytes);
    if (ZSTD_isError(got)) return Status::corruption(std::string("zstd: ") + ZSTD_getErrorName(got));
    if (got != want) return Status::corruption("zstd: decompressed to the wrong size");
    buffer->swap(next);
    data = buffer->data();
  }
  *values = data;
  return Status::ok();
}

}  // namespace

Status decode_tensor(const CodecRecord& rec, const uint8_t* payload, size_t payload_bytes, float* out, size_t n) {
  thread_local std::vector<uint8_t> buffer;
  const uint8_t* values = nullptr;
  XD_RETURN_IF_ERROR(undo_byte_stages(rec, payload, payload_bytes, n, &buffer, &values));
  return decode_values(rec.stages.front(), values, rec.shape.rows, rec.shape.cols, out);
}

bool is_sparse(const CodecRecord& record) {
  return !record.stages.empty() && is_sparse_kind(record.stages.front().kind);
}

Status decode_sparse(const CodecRecord& rec, const uint8_t* payload, size_t payload_bytes, SparseTensor* out) {
  out->index.clear();
  out->value.clear();
  if (!is_sparse(rec))
    return Status::invalid_argument("decode_sparse: the value codec is none of topk, topk_sign and block_sign");
  const uint64_t n = rec.shape.elements();
  if (n > std::numeric_limits<uint32_t>::max())
    return Status::corruption(std::string(detail::codec_kind_name(rec.stages.front().kind)) + ": tensor above 2^32 elements");
  thread_local std::vector<uint8_t> buffer;
  const uint8_t* values = nullptr;
  XD_RETURN_IF_ERROR(undo_byte_stages(rec, payload, payload_bytes, n, &buffer, &values));
  const CodecStageRecord& s = rec.stages.front();
  if (s.kind == CodecKind::kBlockSign) {
    XD_RETURN_IF_ERROR(detail::check_block_sign(values, rec.shape.rows, rec.shape.cols, s.block, s.kept));
    out->index.resize(s.kept);  // kept <= n <= 2^32 (checked above)
    out->value.resize(s.kept);
    uint32_t* index = out->index.data();
    float* value = out->value.data();
    detail::for_each_block_sign(values, rec.shape.rows, rec.shape.cols, s.block,
                                [index, value](uint64_t j, uint64_t i, float v) {
                                  index[j] = static_cast<uint32_t>(i);
                                  value[j] = v;
                                });
    return Status::ok();
  }
  if (every_sign_payload(s, values, rec.shape.rows, rec.shape.cols)) {
    out->value.resize(n);
    XD_RETURN_IF_ERROR(decode_every_sign_checked(s, values, rec.shape.rows, rec.shape.cols, out->value.data()));
    detail::every_index(n, &out->index);
    return Status::ok();
  }
  out->index.reserve(rec.stages.front().kept);
  out->value.reserve(rec.stages.front().kept);
  return for_each_kept(rec.stages.front(), values, rec.shape.rows, rec.shape.cols, [out](uint64_t i, float v) {
    out->index.push_back(static_cast<uint32_t>(i));
    out->value.push_back(v);
  });
}

}  // namespace xd
