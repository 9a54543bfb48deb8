// The codec record: what a tensor's codec pipeline did to it (its shape and,
// per stage, the codec, its output size and parameters), carried in the wire
// format's metadata frame as a msgpack map (layout: compression/codec_format.h).
// Unpacking checks everything a decoder relies on before it reads a payload
// byte: a known version and codec kinds, each stage's required fields and
// nothing else, bounded shapes and block sizes, a value codec first and only
// first. Stateless; thread-safe.
#pragma once

#include <string>

#include "common/status.h"
#include "compression/codec.h"

namespace xd::detail {

const char* codec_kind_name(CodecKind k);
inline bool is_value_codec(CodecKind k) { return k != CodecKind::kZstd; }
inline bool is_top_k(CodecKind k) { return k == CodecKind::kTopK || k == CodecKind::kTopKSign; }
inline bool is_sparse_kind(CodecKind k) { return is_top_k(k) || k == CodecKind::kBlockSign; }
inline bool is_int_rows(CodecKind k) { return k == CodecKind::kInt8Row || k == CodecKind::kInt4Row; }

std::string pack_codec_record(const CodecRecord& r);
// Corruption, naming the rule a record breaks.
Expected<CodecRecord> unpack_codec_record(const std::string& metadata);

}  // namespace xd::detail
