#include "compression/codec.h"

#include <msgpack.hpp>
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "compression/detail/block_sign.h"
#include "compression/detail/every_sign.h"
#include "compression/detail/int_rows.h"
#include "compression/detail/number_formats.h"
#include "compression/detail/top_k.h"

namespace xd {

namespace {

const char* kind_name(CodecKind k) {
  switch (k) {
    case CodecKind::kRaw: return "raw";
    case CodecKind::kBf16: return "bf16";
    case CodecKind::kFp16: return "fp16";
    case CodecKind::kInt8Row: return "int8_row";
    case CodecKind::kTopK: return "topk";
    case CodecKind::kZstd: return "zstd";
    case CodecKind::kTopKSign: return "topk_sign";
    case CodecKind::kBlockSign: return "block_sign";
    case CodecKind::kInt4Row: return "int4_row";
  }
  return "?";
}

bool is_value_codec(CodecKind k) { return k != CodecKind::kZstd; }
bool is_top_k(CodecKind k) { return k == CodecKind::kTopK || k == CodecKind::kTopKSign; }
bool is_sparse_kind(CodecKind k) { return is_top_k(k) || k == CodecKind::kBlockSign; }
bool is_int_rows(CodecKind k) { return k == CodecKind::kInt8Row || k == CodecKind::kInt4Row; }
uint64_t sign_bytes(uint64_t kept) { return (kept + 7) / 8; }

Status first_non_finite(const float* x, uint64_t n, const char* codec) {
  // One branch-free pass over the exponent bits (it vectorizes); the
  // element is looked for only when there is one.
  uint32_t non_finite = 0;
  for (uint64_t i = 0; i < n; ++i) non_finite |= (std::bit_cast<uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u;
  if (!non_finite) return Status::ok();
  for (uint64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      return Status::invalid_argument(std::string(codec) + " cannot encode a non-finite value (element " +
                                      std::to_string(i) + " is " + std::to_string(x[i]) + ")");
  return Status::ok();
}

// ---- value codecs: floats -> bytes, bytes -> floats -------------------------

// topk_sign's values after the index list: each row's scale (the mean |x| of
// its kept entries), then one sign bit per kept entry. Returns the end. With
// `decoded`, appends each kept entry's value as the decoder will give it.
uint8_t* put_signs_and_scales(const float* x, TensorShape shape, const std::vector<uint32_t>& kept, uint8_t* p,
                              std::vector<float>* decoded) {
  // `kept` ascends, so each row's entries are one run of it: a cursor finds
  // the rows (no division per entry); each row's sum adds in index order.
  const size_t n = kept.size();
  if (decoded) decoded->reserve(decoded->size() + n);
  size_t j = 0;
  for (uint64_t r = 0; r < shape.rows; ++r) {
    const size_t first = j;
    j = std::lower_bound(kept.begin() + first, kept.end(), (r + 1) * shape.cols) - kept.begin();
    double sum = 0;
    for (size_t k = first; k < j; ++k) sum += std::abs(x[kept[k]]);
    const float scale = j > first ? static_cast<float>(sum / static_cast<double>(j - first)) : 0.0f;
    std::memcpy(p, &scale, sizeof(float));
    p += sizeof(float);
    if (decoded)
      for (size_t k = first; k < j; ++k) decoded->push_back(std::signbit(x[kept[k]]) ? -scale : scale);
  }
  for (size_t byte = 0; byte < n / 8; ++byte) {  // whole bytes of 8 signs, then the tail
    uint8_t b = 0;
    for (int bit = 0; bit < 8; ++bit) b |= static_cast<uint8_t>(std::signbit(x[kept[8 * byte + bit]])) << bit;
    p[byte] = b;
  }
  if (n % 8) {
    uint8_t b = 0;
    for (size_t k = n - n % 8; k < n; ++k) b |= static_cast<uint8_t>(std::signbit(x[kept[k]])) << (k % 8);
    p[n / 8] = b;
  }
  return p + sign_bytes(n);
}

std::string pack_record(const CodecRecord& r) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(4);
  pk.pack(std::string("v"));
  pk.pack(kCodecFormatVersion);
  pk.pack(std::string("rows"));
  pk.pack(r.shape.rows);
  pk.pack(std::string("cols"));
  pk.pack(r.shape.cols);
  pk.pack(std::string("stages"));
  pk.pack_array(static_cast<uint32_t>(r.stages.size()));
  for (const CodecStageRecord& s : r.stages) {
    const bool block = s.kind == CodecKind::kBlockSign;
    const bool scale_block = is_int_rows(s.kind) && s.block != 0;
    const bool extra = is_sparse_kind(s.kind) || s.kind == CodecKind::kZstd || scale_block;
    pk.pack_map(block ? 4 : extra ? 3 : 2);
    pk.pack(std::string("kind"));
    pk.pack(static_cast<uint8_t>(s.kind));
    pk.pack(std::string("bytes"));
    pk.pack(s.bytes);
    if (is_sparse_kind(s.kind)) {
      pk.pack(std::string("kept"));
      pk.pack(s.kept);
    }
    if (block || scale_block) {
      pk.pack(std::string("block"));
      pk.pack(s.block);
    } else if (s.kind == CodecKind::kZstd) {
      pk.pack(std::string("level"));
      pk.pack(s.level);
    }
  }
  return std::string(buf.data(), buf.size());
}

Status bad(const std::string& why) { return Status::corruption("codec metadata: " + why); }

// One zstd compression and one decompression context per thread, reused, so
// a tensor pays for no context's allocation and table set-up. The frames are
// those of ZSTD_compress and ZSTD_decompress (the same parameters). Null
// when zstd could not allocate one.
struct ZstdContexts {
  ZSTD_CCtx* compress = ZSTD_createCCtx();
  ZSTD_DCtx* decompress = ZSTD_createDCtx();
  ZstdContexts() = default;
  ZstdContexts(const ZstdContexts&) = delete;
  ZstdContexts& operator=(const ZstdContexts&) = delete;
  ~ZstdContexts() {
    ZSTD_freeCCtx(compress);
    ZSTD_freeDCtx(decompress);
  }
};

ZstdContexts& zstd_contexts() {
  thread_local ZstdContexts contexts;
  return contexts;
}

// Reads an unsigned integer field of a msgpack map entry.
bool as_u64(const msgpack::object& o, uint64_t* v) {
  if (o.type != msgpack::type::POSITIVE_INTEGER) return false;
  *v = o.via.u64;
  return true;
}

Expected<CodecRecord> unpack_record(const std::string& metadata) {
  CodecRecord r;
  try {
    // Small limits: a record holds a handful of stages, nothing nested deeper.
    const msgpack::unpack_limit limit(/*array*/ 16, /*map*/ 16, /*str*/ 16, /*bin*/ 0, /*ext*/ 0, /*depth*/ 4);
    msgpack::object_handle oh = msgpack::unpack(metadata.data(), metadata.size(), nullptr, nullptr, limit);
    const msgpack::object& root = oh.get();
    if (root.type != msgpack::type::MAP) return bad("not a map");
    bool have_v = false, have_rows = false, have_cols = false, have_stages = false;
    for (uint32_t i = 0; i < root.via.map.size; ++i) {
      const msgpack::object_kv& kv = root.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR) return bad("a key is not a string");
      const std::string key(kv.key.via.str.ptr, kv.key.via.str.size);
      uint64_t v = 0;
      if (key == "v") {
        if (!as_u64(kv.val, &v)) return bad("'v' is not an integer");
        if (v != kCodecFormatVersion)
          return bad("format version " + std::to_string(v) + ", this build reads " +
                     std::to_string(kCodecFormatVersion));
        have_v = true;
      } else if (key == "rows") {
        if (!as_u64(kv.val, &r.shape.rows)) return bad("'rows' is not an integer");
        have_rows = true;
      } else if (key == "cols") {
        if (!as_u64(kv.val, &r.shape.cols)) return bad("'cols' is not an integer");
        have_cols = true;
      } else if (key == "stages") {
        if (kv.val.type != msgpack::type::ARRAY) return bad("'stages' is not a list");
        have_stages = true;
        for (uint32_t s = 0; s < kv.val.via.array.size; ++s) {
          const msgpack::object& so = kv.val.via.array.ptr[s];
          if (so.type != msgpack::type::MAP) return bad("stage " + std::to_string(s) + " is not a map");
          CodecStageRecord st;
          bool have_kind = false, have_bytes = false, have_kept = false, have_level = false, have_block = false;
          for (uint32_t f = 0; f < so.via.map.size; ++f) {
            const msgpack::object_kv& skv = so.via.map.ptr[f];
            if (skv.key.type != msgpack::type::STR) return bad("a stage key is not a string");
            const std::string sk(skv.key.via.str.ptr, skv.key.via.str.size);
            if (!as_u64(skv.val, &v)) return bad("stage field '" + sk + "' is not an unsigned integer");
            if (sk == "kind") {
              if (v > static_cast<uint64_t>(CodecKind::kInt4Row))
                return bad("unknown codec kind " + std::to_string(v));
              st.kind = static_cast<CodecKind>(v);
              have_kind = true;
            } else if (sk == "bytes") {
              st.bytes = v;
              have_bytes = true;
            } else if (sk == "kept") {
              st.kept = v;
              have_kept = true;
            } else if (sk == "block") {
              if (v < 1 || v > kMaxCodecBlock) return bad("block of " + std::to_string(v) + " entries");
              st.block = v;
              have_block = true;
            } else if (sk == "level") {
              if (v > 22) return bad("zstd level " + std::to_string(v));
              st.level = static_cast<int>(v);
              have_level = true;
            } else {
              return bad("unknown stage field '" + sk + "'");
            }
          }
          if (!have_kind || !have_bytes) return bad("stage " + std::to_string(s) + " lacks its kind or size");
          if (is_sparse_kind(st.kind) && !have_kept)
            return bad(std::string(kind_name(st.kind)) + " stage without 'kept'");
          if (st.kind == CodecKind::kBlockSign && !have_block) return bad("block_sign stage without 'block'");
          if (have_block && st.kind != CodecKind::kBlockSign && !is_int_rows(st.kind))
            return bad(std::string(kind_name(st.kind)) + " stage with a 'block'");
          if (st.kind == CodecKind::kZstd && !have_level) return bad("zstd stage without 'level'");
          r.stages.push_back(st);
        }
      } else {
        return bad("unknown key '" + key + "'");
      }
    }
    if (!have_v || !have_rows || !have_cols || !have_stages) return bad("a required key is missing");
  } catch (const std::exception& e) {
    return bad(std::string("malformed msgpack (") + e.what() + ")");
  }
  // Rows are bounded even without columns: a whole-row int8_row or int4_row
  // scale costs 4 bytes a row, and their decoders walk every row.
  if (r.shape.rows > kMaxCodecElements || r.shape.cols > kMaxCodecElements) return bad("shape too large");
  if (r.shape.cols != 0 && r.shape.rows > kMaxCodecElements / r.shape.cols) return bad("shape too large");
  if (r.shape.elements() > kMaxCodecElements) return bad("shape too large");
  if (r.stages.empty() || !is_value_codec(r.stages[0].kind)) return bad("the first stage is not a value codec");
  for (size_t i = 1; i < r.stages.size(); ++i)
    if (is_value_codec(r.stages[i].kind)) return bad("a value codec after the first stage");
  return r;
}

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
      const uint64_t fixed = 4 * rows + sign_bytes(s.kept);
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

// 0, 1, ..., n - 1: the indices of a message that keeps every entry.
void every_index(uint64_t n, std::vector<uint32_t>* index) {
  index->resize(n);
  std::iota(index->begin(), index->end(), 0u);
}

// Calls fn(index, value) for each entry a top-k payload (topk or topk_sign)
// keeps, indices ascending; every index is checked against n and every scale
// for being finite and >= 0 before fn sees them.
template <typename Fn>
Status for_each_kept(const CodecStageRecord& s, const uint8_t* in, uint64_t rows, uint64_t cols, Fn fn) {
  const uint64_t n = rows * cols;
  const char* name = kind_name(s.kind);
  const bool sign = s.kind == CodecKind::kTopKSign;
  // topk: the bf16 values; topk_sign: the row scales, then the sign bits.
  const uint8_t* values = in + s.bytes - (sign ? 4 * rows + sign_bytes(s.kept) : 2 * s.kept);
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

// ---- pipeline ------------------------------------------------------------

Expected<CodecPipeline> CodecPipeline::parse(const std::string& spec) {
  CodecPipeline p;
  size_t start = 0;
  while (start <= spec.size()) {
    const size_t plus = spec.find('+', start);
    const std::string part = spec.substr(start, plus == std::string::npos ? std::string::npos : plus - start);
    const size_t colon = part.find(':');
    const std::string name = part.substr(0, colon), arg = colon == std::string::npos ? "" : part.substr(colon + 1);
    CodecStage s;
    auto number = [&](double* v) {
      char* end = nullptr;
      *v = std::strtod(arg.c_str(), &end);
      return !arg.empty() && end && *end == 0;
    };
    const std::string where = "codec '" + spec + "': ";
    if (name == "raw" || name == "bf16" || name == "fp16") {
      if (!arg.empty()) return Status::invalid_argument(where + name + " takes no parameter");
      s.kind = name == "raw" ? CodecKind::kRaw : name == "bf16" ? CodecKind::kBf16 : CodecKind::kFp16;
    } else if (name == "int8_row" || name == "int4_row") {
      s.kind = name == "int8_row" ? CodecKind::kInt8Row : CodecKind::kInt4Row;
      if (!arg.empty()) {
        double b = 0;
        if (!number(&b) || b < 1 || b > kMaxCodecBlock || b != std::floor(b))
          return Status::invalid_argument(where + name + "'s scale block must be an integer in 1.." +
                                          std::to_string(kMaxCodecBlock) + " entries, e.g. " + name + ":64");
        s.scale_block = static_cast<uint64_t>(b);
      }
    } else if (name == "topk" || name == "topk_sign") {
      s.kind = name == "topk" ? CodecKind::kTopK : CodecKind::kTopKSign;
      if (!number(&s.density) || !(s.density > 0 && s.density <= 1))
        return Status::invalid_argument(where + name + " needs the kept fraction in (0, 1], e.g. " + name + ":0.01");
    } else if (name == "block_sign") {
      s.kind = CodecKind::kBlockSign;
      const size_t second = arg.find(':');
      const std::string fraction = arg.substr(0, second);
      const std::string size = second == std::string::npos ? "" : arg.substr(second + 1);
      char* end = nullptr;
      s.density = std::strtod(fraction.c_str(), &end);
      if (fraction.empty() || !end || *end != 0 || !(s.density > 0 && s.density <= 1))
        return Status::invalid_argument(where +
                                        "block_sign needs the kept fraction of blocks in (0, 1], e.g. block_sign:0.5");
      if (second != std::string::npos) {
        const double b = std::strtod(size.c_str(), &end);
        if (size.empty() || !end || *end != 0 || b < 1 || b > kMaxCodecBlock || b != std::floor(b))
          return Status::invalid_argument(where + "block_sign's block size must be an integer in 1.." +
                                          std::to_string(kMaxCodecBlock) + ", e.g. block_sign:0.5:16");
        s.block = static_cast<uint64_t>(b);
      }
    } else if (name == "zstd") {
      s.kind = CodecKind::kZstd;
      double level = 3;
      if (!arg.empty() && (!number(&level) || level < 1 || level > 19 || level != std::floor(level)))
        return Status::invalid_argument(where + "zstd level must be an integer in 1..19");
      s.level = static_cast<int>(level);
      if (p.stages_.empty()) p.stages_.push_back(CodecStage{});  // "zstd" alone: raw+zstd
    } else {
      return Status::invalid_argument(where + "unknown stage '" + name +
                                      "' (use raw, bf16, fp16, int8_row[:B], int4_row[:B], topk:D, topk_sign:D, "
                                      "block_sign:D[:B], then +zstd[:L])");
    }
    if (is_value_codec(s.kind) && !p.stages_.empty())
      return Status::invalid_argument(where + "only the first stage may be a value codec");
    p.stages_.push_back(s);
    if (plus == std::string::npos) break;
    start = plus + 1;
  }
  if (p.stages_.size() > 2) return Status::invalid_argument("codec '" + spec + "': at most one zstd stage");
  return p;
}

CodecPipeline CodecPipeline::raw() {
  CodecPipeline p;
  p.stages_.push_back(CodecStage{});
  return p;
}

std::string CodecPipeline::spec() const {
  std::string s;
  for (const CodecStage& st : stages_) {
    if (!s.empty()) s += "+";
    s += kind_name(st.kind);
    if (is_top_k(st.kind)) {
      char buf[32];
      std::snprintf(buf, sizeof buf, ":%.17g", st.density);
      s += buf;
    } else if (st.kind == CodecKind::kBlockSign) {
      char buf[48];
      std::snprintf(buf, sizeof buf, ":%.17g:%llu", st.density, static_cast<unsigned long long>(st.block));
      s += buf;
    } else if (is_int_rows(st.kind) && st.scale_block != 0) {
      s += ":" + std::to_string(st.scale_block);
    } else if (st.kind == CodecKind::kZstd) {
      s += ":" + std::to_string(st.level);
    }
  }
  return s;
}

bool CodecPipeline::is_raw() const { return stages_.size() == 1 && stages_.front().kind == CodecKind::kRaw; }

bool CodecPipeline::is_sparse() const { return is_sparse_kind(stages_.front().kind); }

Status CodecPipeline::encode(const float* data, TensorShape shape, EncodedTensor* out, SparseTensor* sparse) const {
  if (sparse) {
    sparse->index.clear();
    sparse->value.clear();
  }
  const uint64_t n = shape.elements();
  if ((shape.cols != 0 && shape.rows > kMaxCodecElements / shape.cols) || n > kMaxCodecElements)
    return Status::invalid_argument("tensor too large to encode");
  CodecRecord rec{shape, {}};
  const CodecStage& v = stages_.front();
  CodecStageRecord first{v.kind, 0, 0, 0, 0};
  std::vector<uint8_t>& bytes = out->payload;
  switch (v.kind) {
    case CodecKind::kRaw:
      bytes.resize(4 * n);
      if (n) std::memcpy(bytes.data(), data, 4 * n);
      break;
    case CodecKind::kBf16:
      bytes.resize(2 * n);
      for (uint64_t i = 0; i < n; ++i) {
        const uint16_t h = detail::float_to_bf16(data[i]);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
      break;
    case CodecKind::kFp16:
      bytes.resize(2 * n);
      detail::floats_to_fp16(data, n, bytes.data());
      break;
    case CodecKind::kInt8Row:
    case CodecKind::kInt4Row: {
      const bool four = v.kind == CodecKind::kInt4Row;
      XD_RETURN_IF_ERROR(first_non_finite(data, n, kind_name(v.kind)));
      first.block = v.scale_block;
      bytes.resize(four ? detail::int4_row_bytes(shape.rows, shape.cols, v.scale_block)
                        : detail::int8_row_bytes(shape.rows, shape.cols, v.scale_block));
      (four ? detail::encode_int4_rows : detail::encode_int8_rows)(data, shape.rows, shape.cols, v.scale_block,
                                                                   bytes.data());
      break;
    }
    case CodecKind::kTopK:
    case CodecKind::kTopKSign: {
      const char* name = kind_name(v.kind);
      XD_RETURN_IF_ERROR(first_non_finite(data, n, name));
      if (n > std::numeric_limits<uint32_t>::max())
        return Status::invalid_argument(std::string(name) + ": tensor above 2^32 elements");
      thread_local detail::TopKSelector selector;
      thread_local std::vector<uint32_t> kept;
      first.kept = detail::kept_count(v.density, n);
      if (v.kind == CodecKind::kTopKSign && first.kept == n && n > 0 && !detail::has_zero(data, n)) {
        // Every entry and no zero: the same bytes, without a list of indices.
        bytes.resize(detail::every_sign_bytes(shape.rows, shape.cols));
        if (sparse) {
          every_index(n, &sparse->index);
          sparse->value.resize(n);
        }
        detail::encode_every_sign(data, shape.rows, shape.cols, bytes.data(), sparse ? sparse->value.data() : nullptr);
        break;
      }
      if (v.kind == CodecKind::kTopKSign) {  // a zero has no sign to send: +-scale would add error
        if (first.kept == n) {  // every entry: the nonzero ones in one pass, nothing to select
          kept.resize(n);
          uint32_t* out = kept.data();  // branch-free: every index is written, kept when nonzero
          size_t found = 0;
          for (uint64_t i = 0; i < n; ++i) {
            out[found] = static_cast<uint32_t>(i);
            found += data[i] != 0.0f;
          }
          kept.resize(found);
        } else {
          selector.select(data, n, first.kept, &kept);
          auto zero = [data](uint32_t i) { return data[i] == 0.0f; };
          kept.erase(std::remove_if(kept.begin(), kept.end(), zero), kept.end());
        }
        first.kept = kept.size();
      } else {
        selector.select(data, n, first.kept, &kept);
      }
      // The varints' exact size, then the values.
      const uint32_t* index = kept.data();  // not the thread_local itself in the loops
      size_t index_bytes = 0;
      for (size_t j = 0; j < kept.size(); ++j)
        index_bytes += detail::varint_size(j == 0 ? index[j] : index[j] - index[j - 1]);
      bytes.resize(index_bytes + (v.kind == CodecKind::kTopK ? 2 * first.kept
                                                             : 4 * shape.rows + sign_bytes(first.kept)));
      uint8_t* p = bytes.data();
      uint32_t previous = 0;
      for (size_t j = 0; j < kept.size(); ++j) {
        detail::put_varint(j == 0 ? index[j] : index[j] - previous, p);
        previous = index[j];
      }
      if (v.kind == CodecKind::kTopK) {
        for (uint32_t i : kept) {
          const uint16_t h = detail::float_to_bf16(data[i]);
          std::memcpy(p, &h, 2);
          p += 2;
          if (sparse) sparse->value.push_back(detail::bf16_to_float(h));
        }
      } else {
        p = put_signs_and_scales(data, shape, kept, p, sparse ? &sparse->value : nullptr);
      }
      if (sparse) sparse->index.assign(kept.begin(), kept.end());
      bytes.resize(p - bytes.data());
      break;
    }
    case CodecKind::kBlockSign:
      XD_RETURN_IF_ERROR(first_non_finite(data, n, "block_sign"));
      if (n > std::numeric_limits<uint32_t>::max())
        return Status::invalid_argument("block_sign: tensor above 2^32 elements");
      first.block = v.block;
      bytes = detail::encode_block_sign(data, shape.rows, shape.cols, v.block, v.density, &first.kept,
                                        sparse ? &sparse->index : nullptr, sparse ? &sparse->value : nullptr);
      break;
    case CodecKind::kZstd:
      return Status::internal("zstd is not a value codec");
  }
  first.bytes = bytes.size();
  rec.stages.push_back(first);
  for (size_t i = 1; i < stages_.size(); ++i) {  // zstd
    ZSTD_CCtx* context = zstd_contexts().compress;
    if (!context) return Status::internal("zstd: no compression context (out of memory)");
    thread_local std::vector<uint8_t> z;  // only grows: no allocation or zero-fill per tensor
    if (z.size() < ZSTD_compressBound(bytes.size())) z.resize(ZSTD_compressBound(bytes.size()));
    const size_t got = ZSTD_compressCCtx(context, z.data(), z.size(), bytes.data(), bytes.size(), stages_[i].level);
    if (ZSTD_isError(got)) return Status::internal(std::string("zstd: ") + ZSTD_getErrorName(got));
    bytes.assign(z.data(), z.data() + got);
    rec.stages.push_back(CodecStageRecord{CodecKind::kZstd, bytes.size(), 0, 0, stages_[i].level});
  }
  out->metadata = pack_record(rec);
  return Status::ok();
}

Expected<CodecRecord> parse_codec_record(const std::string& metadata) { return unpack_record(metadata); }

Status decode_tensor(const std::string& metadata, const uint8_t* payload, size_t payload_bytes, float* out,
                     size_t n) {
  auto rec = unpack_record(metadata);
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
    return Status::corruption(std::string(kind_name(value.kind)) + ": " + std::to_string(value.bytes) +
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
    ZSTD_DCtx* context = zstd_contexts().decompress;
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
    return Status::corruption(std::string(kind_name(rec.stages.front().kind)) + ": tensor above 2^32 elements");
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
    every_index(n, &out->index);
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
