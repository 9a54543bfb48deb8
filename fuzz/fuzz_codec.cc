// Feeds the tensor codecs (compression/codec.h, compression/expert_codec.h) a
// hostile encoded tensor and hostile codec specs. Input: byte 0 picks a codec
// spec from kSpecs, bytes 1-2 (little-endian) are the metadata length, then
// the msgpack metadata record (compression/codec_format.h), then the payload.
//   - parse_codec_record on the metadata; when it passes and the tensor is
//     small enough to allocate, decode_tensor (both forms), decode_sparse
//     for top-k (it must agree with the dense decode) and the picked SR
//     expert codec's decode, at the element count the record claims.
//   - The payload's bytes as floats, encoded with the picked spec and decoded
//     again: must succeed (unless the codec refuses non-finite input), and
//     give back the same bits for the lossless codecs.
//   - The first bytes as a spec string: ExpertCodecSpec::parse, and
//     parse(spec()) must give the same spec.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "compression/codec.h"
#include "compression/expert_codec.h"

namespace {

constexpr const char* kSpecs[] = {
    "raw",          "bf16",          "fp16",      "int8_row",          "topk:0.1",
    "topk:1",       "zstd",          "raw+zstd:1", "bf16+zstd",        "fp16+zstd:19",
    "int8_row+zstd", "topk:0.02+zstd", "topk:0.5+zstd:3",
    "topk_sign:0.1", "topk_sign:0.02+zstd:1", "block_sign:0.5", "block_sign:0.25:4+zstd:1",
    "topk_sign:1+zstd:1", "int4_row", "int4_row+zstd:1", "int8_row:3", "int4_row:3+zstd:1",
};
constexpr size_t kNumSpecs = sizeof(kSpecs) / sizeof(kSpecs[0]);
constexpr uint64_t kMaxElements = uint64_t(1) << 22;  // what this receiver would allocate

bool lossless(const std::string& spec) { return spec == "raw" || spec == "zstd" || spec == "raw+zstd:1"; }

void decode_hostile(const std::string& metadata, const uint8_t* payload, size_t payload_bytes,
                    const xd::ExpertResidualCodec& expert) {
  xd::Expected<xd::CodecRecord> rec = xd::parse_codec_record(metadata);
  if (!rec) return;
  const uint64_t n = rec->shape.elements();
  if (n > kMaxElements || rec->shape.rows > kMaxElements) return;  // a receiver checks the shape first
  std::vector<float> out(n), again(n), base(n, 1.0f);
  const xd::Status st = xd::decode_tensor(*rec, payload, payload_bytes, out.data(), n);
  if (xd::decode_tensor(metadata, payload, payload_bytes, again.data(), n).is_ok() != st.is_ok()) std::abort();
  (void)xd::decode_tensor(*rec, payload, payload_bytes, again.data(), n + 1);  // a size mismatch is an error
  // The sparse decoder accepts what the dense one accepts, and its entries
  // are the dense result's.
  if (xd::is_sparse(*rec)) {
    xd::SparseTensor sparse;
    if (xd::decode_sparse(*rec, payload, payload_bytes, &sparse).is_ok() != st.is_ok()) std::abort();
    if (st.is_ok())
      for (size_t j = 0; j < sparse.index.size(); ++j)
        if (sparse.index[j] >= n || std::memcmp(&out[sparse.index[j]], &sparse.value[j], sizeof(float)) != 0) std::abort();
  }
  (void)expert.decode(metadata, payload, payload_bytes, base.data(), again.data(), n);
}

void round_trip(const char* spec, const uint8_t* bytes, size_t size, uint8_t shape_byte) {
  const size_t n = size / sizeof(float);
  std::vector<float> in(n);
  if (n) std::memcpy(in.data(), bytes, n * sizeof(float));
  const uint64_t rows = n ? 1 + shape_byte % 4 : shape_byte % 3;
  const xd::TensorShape shape{rows, n / (rows ? rows : 1)};
  const uint64_t elements = shape.elements();
  auto pipeline = xd::CodecPipeline::parse(spec);
  if (!pipeline) std::abort();
  xd::EncodedTensor enc;
  xd::SparseTensor kept;
  if (!pipeline->encode(in.data(), shape, &enc, &kept).is_ok()) return;  // non-finite input to int8_row or topk
  std::vector<float> out(elements);
  const xd::Status st = xd::decode_tensor(enc.metadata, enc.payload.data(), enc.payload.size(), out.data(), elements);
  if (!st.is_ok()) {
    std::fprintf(stderr, "%s: own encoding refused: %s\n", spec, st.to_string().c_str());
    std::abort();
  }
  if (lossless(spec) && elements && std::memcmp(out.data(), in.data(), elements * sizeof(float)) != 0) std::abort();
  // A top-k encoder's own list of kept entries is what the decoder gives.
  if (pipeline->is_sparse()) {
    auto rec = xd::parse_codec_record(enc.metadata);
    xd::SparseTensor decoded;
    if (!rec || !xd::decode_sparse(*rec, enc.payload.data(), enc.payload.size(), &decoded).is_ok()) std::abort();
    if (decoded.index != kept.index || decoded.value.size() != kept.value.size()) std::abort();
    if (!kept.value.empty() &&
        std::memcmp(decoded.value.data(), kept.value.data(), kept.value.size() * sizeof(float)) != 0)
      std::abort();
  }
}

void parse_spec(const uint8_t* bytes, size_t size) {
  const std::string text(reinterpret_cast<const char*>(bytes), size < 40 ? size : 40);
  auto spec = xd::ExpertCodecSpec::parse(text);
  if (!spec) return;
  auto again = xd::ExpertCodecSpec::parse(spec->spec());
  if (!again || again->spec() != spec->spec()) {
    std::fprintf(stderr, "spec '%s' does not survive spec(): '%s'\n", text.c_str(), spec->spec().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const char* spec = kSpecs[data[0] % kNumSpecs];
  const size_t meta_len = std::min<size_t>(data[1] | (size_t(data[2]) << 8), size - 3);
  const std::string metadata(reinterpret_cast<const char*>(data + 3), meta_len);
  const uint8_t* payload = data + 3 + meta_len;
  const size_t payload_bytes = size - 3 - meta_len;

  auto expert = xd::ExpertResidualCodec::create(spec);
  if (!expert) std::abort();
  decode_hostile(metadata, payload, payload_bytes, *expert);
  round_trip(spec, payload, payload_bytes, data[0] / kNumSpecs);
  parse_spec(data + 3, size - 3);
  return 0;
}
