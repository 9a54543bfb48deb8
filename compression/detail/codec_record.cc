#include "compression/detail/codec_record.h"

#include <msgpack.hpp>

#include <exception>

#include "compression/codec_format.h"

namespace xd::detail {

namespace {

Status bad(const std::string& why) { return Status::corruption("codec metadata: " + why); }

// Reads an unsigned integer field of a msgpack map entry.
bool as_u64(const msgpack::object& o, uint64_t* v) {
  if (o.type != msgpack::type::POSITIVE_INTEGER) return false;
  *v = o.via.u64;
  return true;
}

}  // namespace

const char* codec_kind_name(CodecKind k) {
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

std::string pack_codec_record(const CodecRecord& r) {
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

Expected<CodecRecord> unpack_codec_record(const std::string& metadata) {
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
            return bad(std::string(codec_kind_name(st.kind)) + " stage without 'kept'");
          if (st.kind == CodecKind::kBlockSign && !have_block) return bad("block_sign stage without 'block'");
          if (have_block && st.kind != CodecKind::kBlockSign && !is_int_rows(st.kind))
            return bad(std::string(codec_kind_name(st.kind)) + " stage with a 'block'");
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

}  // namespace xd::detail
