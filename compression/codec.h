// Codecs for tensors on the wire: a value codec (raw, bf16, fp16, per-row
// int8, top-k sparse with bf16 or 1-bit values, the largest blocks with 1-bit
// values) optionally followed by a zstd stage, composed into a
// CodecPipeline. The layout is compression/codec_format.h.
//
//   auto p = CodecPipeline::parse("topk:0.01+zstd:3");   // or "bf16", "int8_row"
//   EncodedTensor e;  p->encode(data, {rows, cols}, &e);  // e.metadata, e.payload
//   decode_tensor(e.metadata, e.payload, out, n);          // any pipeline's output
//
// The decoder needs no pipeline: the metadata says what was applied.
//
// Non-finite values: raw, bf16 and fp16 keep NaN and +-Inf (bf16 and fp16
// keep a NaN a NaN; a finite value beyond fp16's range becomes +-Inf).
// int8_row, int4_row, topk, topk_sign and block_sign refuse to encode a tensor holding
// NaN or Inf (an error naming the first such element): a scale or a ranking
// of non-finite values means nothing.
//
// A pipeline is immutable after parse(); encode and decode are thread-safe.
// Depends on zstd and msgpack-cxx only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "compression/codec_format.h"

namespace xd {

struct TensorShape {
  uint64_t rows = 1;
  uint64_t cols = 0;
  uint64_t elements() const { return rows * cols; }
};

struct EncodedTensor {
  std::string metadata;          // msgpack record (codec_format.h)
  std::vector<uint8_t> payload;  // the last stage's output
};

// Seconds a sender spent encoding and a receiver decoding, apart: the two
// run on different workers and threads, and cost differently per byte. The
// runtime counts the coding thread's CPU time (thread_cpu_seconds,
// common/clock.h), so a wait for a core or a lock is not a codec's cost.
struct CodecSeconds {
  double encode = 0, decode = 0;
  double total() const { return encode + decode; }
  CodecSeconds& operator+=(const CodecSeconds& o) {
    encode += o.encode, decode += o.decode;
    return *this;
  }
};

// The entries a sparse payload (topk, topk_sign, block_sign) keeps:
// ascending flat indices and their decoded values. A receiver adds them
// where they belong instead of building the dense tensor first (HybridEP's
// SRDecode, recovery fused with addition).
struct SparseTensor {
  std::vector<uint32_t> index;
  std::vector<float> value;
};

// One stage of a pipeline, as written in a spec string.
struct CodecStage {
  CodecKind kind = CodecKind::kRaw;
  double density = 0;        // topk, topk_sign: fraction of entries kept; block_sign: of blocks; (0, 1]
  uint64_t block = 16;       // block_sign: entries per block
  uint64_t scale_block = 0;  // int8_row, int4_row: entries per scale (0: the whole row)
  int level = 3;             // zstd: compression level, 1..19
};

class CodecPipeline {
 public:
  // "raw", "bf16", "fp16", "int8_row", "int4_row" (4-bit integers on a row's
  // scale), "int8_row:B" and "int4_row:B" (one scale per B entries of a row),
  // "topk:D" (D = kept fraction, e.g. 0.01),
  // "topk_sign:D" (the same entries as signs times a per-row scale),
  // "block_sign:D" or "block_sign:D:B" (the fraction D of each row's blocks
  // of B entries, default 16, of largest energy, as signs times a per-row
  // scale),
  // each optionally followed by "+zstd" or "+zstd:LEVEL"; "zstd" alone means
  // "raw+zstd". Errors name the bad part.
  static Expected<CodecPipeline> parse(const std::string& spec);
  static CodecPipeline raw();

  const std::vector<CodecStage>& stages() const { return stages_; }
  std::string spec() const;  // parse(spec()) gives the same pipeline
  bool is_raw() const;       // plain raw: nothing to encode
  bool is_lossless() const;  // raw values, any byte codecs: decode gives the input's bits
  // Whether encode() refuses x[0..n) for holding NaN or Inf (int8_row,
  // int4_row, topk, topk_sign and block_sign do). A sender that must pass
  // them on (a step the non-finite guard will skip) sends x raw instead.
  bool refuses_non_finite(const float* x, uint64_t n) const;

  // data holds shape.elements() floats. Errors: a non-finite input where the
  // codec refuses it, a shape beyond kMaxCodecElements, a sparse codec's
  // tensor above 2^32 elements. With `kept`, a sparse
  // pipeline (topk, topk_sign, block_sign) also gives the entries it keeps,
  // to the bit as decode_sparse decodes them, so a sender need not decode its
  // own message; other pipelines leave it empty.
  Status encode(const float* data, TensorShape shape, EncodedTensor* out, SparseTensor* kept = nullptr) const;
  bool is_sparse() const;  // its value codec is topk, topk_sign or block_sign

 private:
  std::vector<CodecStage> stages_;  // one value codec, then byte codecs
};

// The metadata record, parsed (codec_format.h): the shape and each stage.
struct CodecStageRecord {
  CodecKind kind = CodecKind::kRaw;
  uint64_t bytes = 0;  // this stage's output
  uint64_t kept = 0;   // topk, topk_sign, block_sign: entries kept
  uint64_t block = 0;  // block_sign; int8_row, int4_row: entries per scale (0: the row)
  int level = 0;       // zstd
};
struct CodecRecord {
  TensorShape shape;
  std::vector<CodecStageRecord> stages;  // a value codec, then byte codecs
};

// Reads and checks a metadata record: version, keys, kinds, stage order,
// shape limits. A receiver parses once, checks the shape against what it
// expects before allocating, then decodes from the parsed record.
Expected<CodecRecord> parse_codec_record(const std::string& metadata);

// Decodes an encoded tensor into out[0..n), n = its rows * cols (an error
// when n differs). Never reads outside `payload`.
Status decode_tensor(const CodecRecord& record, const uint8_t* payload, size_t payload_bytes, float* out, size_t n);
// The same, parsing `metadata` first.
Status decode_tensor(const std::string& metadata, const uint8_t* payload, size_t payload_bytes, float* out,
                     size_t n);

bool is_sparse(const CodecRecord& record);  // its value codec is topk, topk_sign or block_sign
// Whether x[0..n) holds a NaN or an infinity (one pass that vectorizes).
bool has_non_finite(const float* x, uint64_t n);
// Decodes a topk-, topk_sign- or block_sign-coded tensor into `out`, with decode_tensor's
// checks (the tensor has record.shape.elements() entries). Other codecs: an
// error.
Status decode_sparse(const CodecRecord& record, const uint8_t* payload, size_t payload_bytes, SparseTensor* out);

}  // namespace xd
