#include "compression/codec.h"

#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "compression/detail/block_sign.h"
#include "compression/detail/codec_record.h"
#include "compression/detail/every_sign.h"
#include "compression/detail/int_rows.h"
#include "compression/detail/number_formats.h"
#include "compression/detail/top_k.h"
#include "compression/detail/zstd_contexts.h"

namespace xd {

namespace {

using detail::is_int_rows;
using detail::is_sparse_kind;
using detail::is_top_k;
using detail::is_value_codec;

Status first_non_finite(const float* x, uint64_t n, const char* codec) {
  // The element is looked for only when there is one.
  if (!has_non_finite(x, n)) return Status::ok();
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
  return p + codec_sign_bytes(n);
}



}  // namespace

// ---- pipeline ------------------------------------------------------------

Expected<CodecPipeline> CodecPipeline::parse(const std::string& spec) {
  if (spec.empty()) return Status::invalid_argument("codec '': empty (raw sends the floats as they are)");
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
    s += detail::codec_kind_name(st.kind);
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

bool CodecPipeline::is_lossless() const { return stages_.front().kind == CodecKind::kRaw; }

bool CodecPipeline::is_sparse() const { return is_sparse_kind(stages_.front().kind); }

bool CodecPipeline::refuses_non_finite(const float* x, uint64_t n) const {
  const CodecKind k = stages_.front().kind;
  return k != CodecKind::kRaw && k != CodecKind::kBf16 && k != CodecKind::kFp16 && has_non_finite(x, n);
}

bool has_non_finite(const float* x, uint64_t n) {
  // One branch-free pass over the exponent bits.
  uint32_t non_finite = 0;
  for (uint64_t i = 0; i < n; ++i) non_finite |= (std::bit_cast<uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u;
  return non_finite != 0;
}

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
      XD_RETURN_IF_ERROR(first_non_finite(data, n, detail::codec_kind_name(v.kind)));
      first.block = v.scale_block;
      bytes.resize(four ? detail::int4_row_bytes(shape.rows, shape.cols, v.scale_block)
                        : detail::int8_row_bytes(shape.rows, shape.cols, v.scale_block));
      (four ? detail::encode_int4_rows : detail::encode_int8_rows)(data, shape.rows, shape.cols, v.scale_block,
                                                                   bytes.data());
      break;
    }
    case CodecKind::kTopK:
    case CodecKind::kTopKSign: {
      const char* name = detail::codec_kind_name(v.kind);
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
          detail::every_index(n, &sparse->index);
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
                                                             : 4 * shape.rows + codec_sign_bytes(first.kept)));
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
    ZSTD_CCtx* context = detail::zstd_contexts().compress;
    if (!context) return Status::internal("zstd: no compression context (out of memory)");
    thread_local std::vector<uint8_t> z;  // only grows: no allocation or zero-fill per tensor
    if (z.size() < ZSTD_compressBound(bytes.size())) z.resize(ZSTD_compressBound(bytes.size()));
    const size_t got = ZSTD_compressCCtx(context, z.data(), z.size(), bytes.data(), bytes.size(), stages_[i].level);
    if (ZSTD_isError(got)) return Status::internal(std::string("zstd: ") + ZSTD_getErrorName(got));
    bytes.assign(z.data(), z.data() + got);
    rec.stages.push_back(CodecStageRecord{CodecKind::kZstd, bytes.size(), 0, 0, stages_[i].level});
  }
  out->metadata = detail::pack_codec_record(rec);
  return Status::ok();
}

}  // namespace xd
